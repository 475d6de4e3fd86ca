"""Fine-tune a small BERT sentence-pair classifier with accelerate: this project's training script as a
user writes one, with its own Accelerator, model, data, optimizer, schedule and loop in
``training_function`` and an evaluation after every epoch. Nothing in it knows of the gradient-sync
harness; ``python -m harness watch scripts/train_classifier.py`` checks it unedited (docs/script.md).

    accelerate launch scripts/train_classifier.py --gradient_accumulation_steps 2
"""

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup, set_seed

VOCAB = 64
PAD = 0


class SentencePairs(Dataset):
    """Pairs of token sequences of varying length; the label says whether they share their first token."""

    def __init__(self, samples: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(samples):
            lengths = torch.randint(3, 9, (2,), generator=generator).tolist()
            first = torch.randint(3, VOCAB, (lengths[0],), generator=generator)
            second = torch.randint(3, VOCAB, (lengths[1],), generator=generator)
            if torch.rand(1, generator=generator) < 0.5:
                second[0] = first[0]
            ids = torch.cat([torch.tensor([1]), first, torch.tensor([2]), second, torch.tensor([2])])
            types = torch.cat([torch.zeros(len(first) + 2, dtype=torch.long),
                               torch.ones(len(second) + 1, dtype=torch.long)])
            self.items.append((ids, types, int(first[0] == second[0])))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]


def collate(examples):
    """Pad to the longest pair of the batch, as a tokenizer's ``pad`` does."""
    longest = max(len(ids) for ids, _, _ in examples)
    input_ids = torch.full((len(examples), longest), PAD)
    token_type_ids = torch.zeros((len(examples), longest), dtype=torch.long)
    attention_mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for row, (ids, types, _) in enumerate(examples):
        input_ids[row, : len(ids)] = ids
        token_type_ids[row, : len(ids)] = types
        attention_mask[row, : len(ids)] = 1
    labels = torch.tensor([label for _, _, label in examples])
    return {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask,
            "labels": labels}


def get_dataloaders(batch_size: int):
    train = DataLoader(SentencePairs(48, seed=1), shuffle=True, collate_fn=collate, batch_size=batch_size)
    evaluation = DataLoader(SentencePairs(16, seed=2), shuffle=False, collate_fn=collate, batch_size=8)
    return train, evaluation


def training_function(args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)
    train_dataloader, eval_dataloader = get_dataloaders(args.batch_size)
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=2)
    model = BertForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps = len(train_dataloader) * args.epochs // args.gradient_accumulation_steps
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    for epoch in range(args.epochs):
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                accelerator.backward(outputs.loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        model.eval()
        correct = total = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                predictions = model(**batch).logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += int((predictions == references).sum())
            total += len(references)
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.3f}")


def main():
    parser = argparse.ArgumentParser(description="Fine-tune a small BERT pair classifier.")
    parser.add_argument("--mixed_precision", default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU")
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()
