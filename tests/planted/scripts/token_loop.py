"""A training script that weighs every valid label token of a window alike, written the way accelerate's
``examples/by_feature/gradient_accumulation_for_autoregressive_models.py`` is: an Accelerator of the
window's steps, each window's micro-batches drawn first, their label tokens counted and the count
gathered over the ranks, ``num_items_in_batch`` passed to the model, the loss multiplied by the steps
and the processes, ``model.no_sync`` for every micro-batch but a window's last. The model is a tiny
Llama of transformers made here (no hub); the sequences are padded to different lengths, so the
micro-batches and the ranks hold different numbers of tokens. ``--mistake`` plants a one-line change
a user could make; without it the loop is right. tests/test_script.py runs it unedited under
``python -m harness watch``.

Mistakes:
  local_count          the window's count is this rank's own, not gathered over the ranks
  not_times_processes  the loss is multiplied by the steps only
  not_times_steps      the loss is multiplied by the processes only
  unshifted_count      counts every label that is not -100, the first of each row too, which the
                       model's loss never predicts (it shifts the labels): what accelerate's example counts
"""

import argparse
import contextlib
import math

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

MISTAKES = ("local_count", "not_times_processes", "not_times_steps", "unshifted_count")
LENGTH = 12


def dataset(size):
    generator = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(size):
        used = int(torch.randint(3, LENGTH + 1, (), generator=generator))
        ids = torch.randint(1, 64, (LENGTH,), generator=generator)
        ids[used:] = 0  # the pad token
        rows.append(ids)
    return rows


def collate(rows):
    input_ids = torch.stack(rows)
    labels = torch.where(input_ids == 0, -100, input_ids)
    return {"input_ids": input_ids, "attention_mask": (input_ids != 0).long(), "labels": labels}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--mistake", choices=MISTAKES)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    steps = args.gradient_accumulation_steps
    accelerator = Accelerator(gradient_accumulation_steps=steps)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=LENGTH,
                         pad_token_id=0)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset(40), batch_size=2, shuffle=False, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    batches = len(loader)
    remainder = batches % steps or steps
    updates = math.ceil(batches / steps)
    for _ in range(args.epochs):
        model.train()
        iterator = iter(loader)
        for update in range(updates):
            window = [next(iterator) for _ in range(steps if update != updates - 1 else remainder)]
            if args.mistake == "unshifted_count":
                local = sum(b["labels"].ne(-100).sum() for b in window)
            else:
                local = sum(b["labels"][..., 1:].ne(-100).sum() for b in window)
            if args.mistake == "local_count":
                num_items_in_batch = local.item()
            else:
                num_items_in_batch = accelerator.gather(local).sum().item()
            for i, batch in enumerate(window):
                last = i == len(window) - 1
                with model.no_sync() if not last and accelerator.num_processes > 1 else contextlib.nullcontext():
                    loss = model(**batch, use_cache=False, num_items_in_batch=num_items_in_batch).loss
                    if args.mistake == "not_times_processes":
                        loss = loss * steps
                    elif args.mistake == "not_times_steps":
                        loss = loss * accelerator.num_processes
                    else:
                        loss = loss * steps * accelerator.num_processes
                    accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()


if __name__ == "__main__":
    main()
