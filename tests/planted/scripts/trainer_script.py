"""A transformers ``Trainer`` script as users write one: a causal LM (a tiny Llama made here, no hub), a
dataset of token sequences padded to different lengths, ``TrainingArguments`` with accumulation, and
``Trainer(...).train()``. ``--trainer`` picks the Trainer: transformers' own, or a subclass whose
``compute_loss`` returns the model's mean loss itself (transformers issue #35856's class: Trainer
then takes the loss as already scaled for the accumulation, since the model accepts loss kwargs, and
it is k times too large), or the same subclass setting ``loss_is_scaled_for_ga = False`` (Trainer divides
it by the steps: each micro-batch's mean weighs the same). tests/test_script_trainer.py runs it
unedited under ``python -m harness watch``.
"""

import argparse
import tempfile

import torch

LENGTH = 12


class Rows(torch.utils.data.Dataset):
    def __init__(self, size):
        generator = torch.Generator().manual_seed(5)
        self.rows = []
        for _ in range(size):
            used = int(torch.randint(3, LENGTH + 1, (), generator=generator))
            ids = torch.randint(1, 64, (LENGTH,), generator=generator)
            ids[used:] = 0  # the pad token
            self.rows.append(ids)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        ids = self.rows[index]
        return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.where(ids == 0, -100, ids)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=("plain", "mean_loss", "mean_loss_flagged"), default="plain")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--epochs", type=float, default=1)
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--zero", type=int, choices=(1, 2, 3), default=None)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=None)
    parser.add_argument("--tokens-per-rank", action="store_true")  # average_tokens_across_devices=False
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    class MeanLossTrainer(Trainer):
        """Returns the model's own mean loss, ignoring num_items_in_batch."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    class FlaggedMeanLossTrainer(MeanLossTrainer):
        loss_is_scaled_for_ga = False

    trainer_class = {"plain": Trainer, "mean_loss": MeanLossTrainer, "mean_loss_flagged": FlaggedMeanLossTrainer}
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=LENGTH,
                         pad_token_id=0)
    model = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=2,
                                     gradient_accumulation_steps=args.gradient_accumulation_steps,
                                     num_train_epochs=args.epochs, learning_rate=1e-3, warmup_steps=2,
                                     logging_steps=1, save_strategy="no", report_to="none", seed=3, bf16=args.bf16,
                                     average_tokens_across_devices=not args.tokens_per_rank,
                                     deepspeed=None if args.zero is None else {
                                         "zero_optimization": {"stage": args.zero}, "bf16": {"enabled": "auto"},
                                         "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                         "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"})
        if args.fsdp is not None:
            training = TrainingArguments(**{**training.to_dict(), "fsdp": "full_shard",
                                            "fsdp_config": {"version": args.fsdp}})
        trainer = trainer_class[args.trainer](model=model, args=training, train_dataset=Rows(args.rows))
        trainer.train()


if __name__ == "__main__":
    main()
