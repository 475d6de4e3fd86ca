"""A training script that accumulates by hand (``no_sync``, the loss divided by the steps), written as a
user writes one: its own Accelerator of one step, model, data and loop in ``main()``. ``--mistake``
plants one of the mistakes users make in such a loop; without it the loop is right. tests/test_script.py
runs it unedited under ``python -m harness watch --num-steps K``.

Mistakes:
  step_at_zero      syncs and steps at ``step % k == 0`` (accelerate's examples/by_feature/gradient_accumulation.py
                    between its PRs #459 and #484, 2022): the first window is one micro-batch divided by k,
                    every later one starts a micro-batch early
  loss_not_divided  each micro-batch's loss is not divided by the steps
  no_zero_grad      the optimizer's gradients are never cleared: each window adds to the last
  never_syncs       every backward under ``no_sync``: the ranks step on their own gradients
  clip_every_batch  clips after every micro-batch, not once before the step
  plain_logits      the model returns logits and the script its own loss (with --loss, correct)

``--syncs every`` never enters ``no_sync``: every micro-batch all-reduces, which costs communication
and gives the same update at every optimizer step (correct, with or without a mistake beside it).
``--optimizer schedule_free`` trains with ``schedulefree.AdamWScheduleFree`` as accelerate's
``examples/by_feature/schedule_free.py`` does: ``optimizer.train()`` before each epoch, ``optimizer.eval()``
and an evaluation over a prepared loader after it (each switch moves every parameter).
``--warmup`` drives the optimizer with a linear warm-up from a learning rate of 0 (a prepared
``LambdaLR``), so that a step taken early moves no parameter.

``--shape`` plants what the harness cannot follow (``iterable``: an IterableDataset; ``two_losses``:
two backwards a batch; ``unprepared_model``: the model never given to ``prepare``) or what it leaves
alone (``second_accelerator``: another Accelerator made after the first, for its ``print``), or a
checkpoint it cannot load offline (``hub_checkpoint``: a config from the Hugging Face hub).
"""

import argparse

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

MISTAKES = ("step_at_zero", "loss_not_divided", "no_zero_grad", "never_syncs", "clip_every_batch", "plain_logits")
SHAPES = ("iterable", "two_losses", "unprepared_model", "second_accelerator", "hub_checkpoint", "reload")


class Stream(IterableDataset):
    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(self.data)


class Classifier(nn.Module):
    """Returns its loss with its logits, as a transformers model does for a batch with labels."""

    def __init__(self, plain: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 3))
        self.plain = plain

    def forward(self, features, labels=None):
        logits = self.body(features)
        if self.plain or labels is None:
            return {"logits": logits}
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def batches_loss(model, batch):
    """The loss of one micro-batch for ``--loss`` (the plain_logits model returns none)."""
    return nn.functional.cross_entropy(model(batch["features"])["logits"], batch["labels"])


def collate(rows):
    return {"features": torch.stack([r[0] for r in rows]), "labels": torch.stack([r[1] for r in rows])}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--mistake", choices=MISTAKES, default=None)
    parser.add_argument("--shape", choices=SHAPES, default=None)
    parser.add_argument("--syncs", choices=("window", "every"), default="window")
    parser.add_argument("--warmup", action="store_true")
    parser.add_argument("--optimizer", choices=("sgd", "schedule_free"), default="sgd")
    args = parser.parse_args()
    k, mistake, shape = args.accumulation, args.mistake, args.shape
    accelerator = Accelerator()
    if shape == "hub_checkpoint":
        from transformers import AutoConfig

        AutoConfig.from_pretrained("gradsync-harness/no-such-checkpoint")
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 6, generator=generator), torch.randint(0, 3, (40,), generator=generator))
    if shape == "iterable":
        loader = DataLoader(Stream(data), batch_size=4, collate_fn=collate)
    else:
        loader = DataLoader(data, batch_size=4, shuffle=True, collate_fn=collate)
    model = Classifier(plain=mistake == "plain_logits")
    if args.optimizer == "schedule_free":
        import schedulefree

        optimizer = schedulefree.AdamWScheduleFree(model.parameters(), lr=0.05, warmup_steps=2)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    evaluation = accelerator.prepare(DataLoader(data, batch_size=8, collate_fn=collate))
    if shape == "unprepared_model":
        optimizer, loader = accelerator.prepare(optimizer, loader)
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if args.warmup:
        scheduler = accelerator.prepare(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: min(1.0, n / 4)))
    if shape == "second_accelerator":
        Accelerator().print("a second Accelerator, for printing")
    for _ in range(args.epochs):
        model.train()
        if args.optimizer == "schedule_free":
            optimizer.train()
        if shape == "reload":  # the weights put back as they were: a load the oracle cannot follow
            model.load_state_dict(model.state_dict())
        for step, batch in enumerate(loader):
            if mistake == "step_at_zero":
                boundary = step % k == 0
            else:
                boundary = (step + 1) % k == 0 or step + 1 == len(loader)
            syncing = (boundary or args.syncs == "every") and mistake != "never_syncs"
            with accelerator.no_sync(model) if not syncing else torch.enable_grad():
                if mistake == "plain_logits":
                    loss = batches_loss(model, batch)
                else:
                    loss = model(**batch)["loss"]
                accelerator.backward(loss if mistake == "loss_not_divided" else loss / k)
                if shape == "two_losses":
                    accelerator.backward(model(**batch)["loss"] / k)
            if mistake == "clip_every_batch":
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            if boundary:
                optimizer.step()
                if args.warmup:
                    scheduler.step()
                if mistake != "no_zero_grad":
                    optimizer.zero_grad()
        model.eval()
        if args.optimizer == "schedule_free":
            optimizer.eval()
        correct = 0
        for batch in evaluation:
            with torch.no_grad():
                predictions = model(**batch)["logits"].argmax(dim=-1)
            predictions, labels = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += int((predictions == labels).sum())


if __name__ == "__main__":
    main()
