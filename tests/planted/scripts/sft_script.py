"""A TRL ``SFTTrainer`` script as its quickstart writes one, offline: a tiny Llama and a word-level
tokenizer made here (no hub), a ``datasets.Dataset`` of texts of different lengths, an ``SFTConfig``
with accumulation, and ``SFTTrainer(...).train()``. tests/test_script_trainer.py runs it unedited
under ``python -m harness watch``.
"""

import argparse
import random
import tempfile

WORDS = ["the", "court", "said", "shares", "rose", "fell", "company", "percent", "market", "on", "tuesday",
         "analysts", "expected", "profit", "quarter", "bank", "deal", "price", "investors", "report"]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {word: n for n, word in enumerate(["<pad>", "<unk>", "<s>", "</s>", *WORDS])}
    words = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--no-checkpointing", action="store_true")
    args = parser.parse_args()
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    generator = random.Random(4)
    texts = [" ".join(generator.choice(WORDS) for _ in range(generator.randint(3, 10))) for _ in range(40)]
    words = tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                         pad_token_id=words.pad_token_id, bos_token_id=words.bos_token_id,
                         eos_token_id=words.eos_token_id)
    model = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as output_dir:
        training = SFTConfig(output_dir=output_dir, per_device_train_batch_size=2,
                             gradient_accumulation_steps=args.gradient_accumulation_steps, num_train_epochs=1,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
                             max_length=16, seed=3, gradient_checkpointing=not args.no_checkpointing)
        trainer = SFTTrainer(model=model, args=training, train_dataset=Dataset.from_dict({"text": texts}),
                             processing_class=words)
        trainer.train()


if __name__ == "__main__":
    main()
