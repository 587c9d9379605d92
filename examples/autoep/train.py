# SPDX-License-Identifier: Apache-2.0
#
# DeepSpeed Team
"""Train a small Mixtral model with DeepSpeed AutoEP (expert parallelism) on a synthetic corpus.

The model is a Hugging Face ``MixtralForCausalLM`` with tiny dimensions and random initialisation (nothing is
downloaded). The corpus is generated here, deterministically: token sequences of variable length drawn from a
sparse random Markov chain, so the loss has something to learn. ``ds_config.json`` turns on AutoEP with the
Mixtral preset, which replaces every Mixtral MoE block by an expert-parallel layer during
``deepspeed.initialize``.

    deepspeed --num_gpus 8 train.py --deepspeed --deepspeed_config ds_config.json

``autoep_size`` in the config must divide the number of ranks.
"""

import argparse
import json
import os
import time

import torch
from tqdm import tqdm
from transformers import MixtralConfig, MixtralForCausalLM

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

PAD_ID = 0


def parse_args():
    parser = argparse.ArgumentParser(description="AutoEP training of a small Mixtral model on synthetic data")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--intermediate-size", type=int, default=128, help="FFN size of each expert")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--min-seq-len", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=48)
    parser.add_argument("--log-interval", type=int, default=10, help="log the loss every N steps")
    parser.add_argument("--metrics-out", default=None, help="rank 0 writes per-step losses and times here (JSON)")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def synthetic_corpus(num_sequences, vocab_size, min_len, max_len, seed):
    """Variable-length sequences from a random Markov chain in which each token has four likely successors."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(1, vocab_size, (vocab_size, 4), generator=g)
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
    lengths = torch.randint(min_len, max_len + 1, (num_sequences, ), generator=g)
    tokens = torch.empty(num_sequences, max_len, dtype=torch.long)
    tokens[:, 0] = torch.randint(1, vocab_size, (num_sequences, ), generator=g)
    for t in range(1, max_len):
        choice = torch.multinomial(probs.expand(num_sequences, 4), 1, generator=g).squeeze(1)
        tokens[:, t] = successors[tokens[:, t - 1], choice]
    return [tokens[i, :lengths[i]] for i in range(num_sequences)]


def collate(sequences, device):
    """Right-pad to the longest sequence of the batch; padding is masked out of attention and loss."""
    length = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), length), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, s in enumerate(sequences):
        input_ids[i, :len(s)] = s
        attention_mask[i, :len(s)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {
        k: v.to(device)
        for k, v in dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels).items()
    }


def main():
    args = parse_args()
    deepspeed.init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)  # every rank builds the same initial weights
    config = MixtralConfig(vocab_size=args.vocab_size,
                           hidden_size=args.hidden_size,
                           intermediate_size=args.intermediate_size,
                           num_hidden_layers=args.num_layers,
                           num_attention_heads=args.num_heads,
                           num_key_value_heads=args.num_kv_heads,
                           num_local_experts=args.num_experts,
                           num_experts_per_tok=args.top_k,
                           max_position_embeddings=args.max_seq_len,
                           pad_token_id=PAD_ID,
                           bos_token_id=None,
                           eos_token_id=None,
                           use_cache=False)
    model = MixtralForCausalLM(config)

    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    device = engine.device
    micro_batch = engine.train_micro_batch_size_per_gpu()
    grad_accum = engine.gradient_accumulation_steps()

    # The same corpus on every rank; rank r reads every world_size-th micro-batch.
    per_step = world_size * micro_batch * grad_accum
    corpus = synthetic_corpus(args.steps * per_step, args.vocab_size, args.min_seq_len, args.max_seq_len, args.seed)

    metrics = {"world_size": world_size, "micro_batch": micro_batch, "steps": [], "loss": [], "step_time_s": []}
    engine.train()
    progress = tqdm(range(args.steps), desc="train", disable=rank != 0, dynamic_ncols=True)
    for step in progress:
        stats = torch.zeros(2, dtype=torch.float32, device=device)  # [sum of token losses, tokens]
        get_accelerator().synchronize()
        start = time.perf_counter()
        for micro in range(grad_accum):
            first = (step * grad_accum + micro) * world_size * micro_batch + rank * micro_batch
            batch = collate(corpus[first:first + micro_batch], device)
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            tokens = (batch["labels"][:, 1:] != -100).sum()
            stats += torch.stack((loss.detach().float() * tokens, tokens.float()))
        get_accelerator().synchronize()
        step_time = time.perf_counter() - start

        dist.all_reduce(stats)  # token-weighted mean over all ranks
        step_loss = (stats[0] / stats[1]).item()
        metrics["steps"].append(step + 1)
        metrics["loss"].append(step_loss)
        metrics["step_time_s"].append(step_time)
        progress.set_postfix(loss=f"{step_loss:.4f}")
        if rank == 0 and ((step + 1) % args.log_interval == 0 or step == 0 or step + 1 == args.steps):
            progress.write(f"step {step + 1:4d}  loss {step_loss:.4f}  step time {step_time * 1000:.0f} ms  "
                           f"lr {engine.get_lr()[0]:.2e}")

    if rank == 0 and args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump(metrics, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
