"""A script that fine-tunes a pretrained transformers checkpoint, as users' scripts load theirs:
``AutoModelForSequenceClassification.from_pretrained(--checkpoint)``, a tokenizer-free batch of token
ids with labels, accelerate's ``accumulate``. ``--sizes FILE`` writes the loaded model's layer count
and width there, so that a test can see what ``python -m harness watch --tiny-model`` built."""

import argparse
import json

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForSequenceClassification


class Tokens(Dataset):
    def __init__(self, vocab: int) -> None:
        generator = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, vocab, (24, 10), generator=generator)
        self.labels = torch.randint(0, 2, (24,), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--sizes", default=None)
    args = parser.parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = AutoModelForSequenceClassification.from_pretrained(args.checkpoint, num_labels=2)
    if args.sizes and accelerator.is_main_process:
        with open(args.sizes, "w") as out:
            json.dump({"layers": model.config.num_hidden_layers, "width": model.config.hidden_size}, out)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(Tokens(model.config.vocab_size), batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()


if __name__ == "__main__":
    main()
