# SPDX-License-Identifier: Apache-2.0
#
# DeepSpeed Team
"""Fine-tune a small Qwen3-MoE (or Qwen3.5-MoE) model with Hugging Face's ``Trainer`` and DeepSpeed AutoEP.

This is how most people drive DeepSpeed: a ``transformers.Trainer`` script, the DeepSpeed config handed to
``TrainingArguments(deepspeed=...)`` with ``"auto"`` values that the Trainer fills in, and accelerate
underneath calling ``deepspeed.initialize`` with the Trainer's own optimizer param groups (weight decay on,
off for norms and biases). ``ds_config_trainer.json`` turns on AutoEP with the ``qwen3_moe`` preset, which
replaces every MoE block by an expert-parallel layer during ``deepspeed.initialize``; the expert all-to-all
transport is chosen with ``DEEPSPEED_AUTOEP_COMM_BACKEND``, and what it overlaps with
``DEEPSPEED_AUTOEP_COMM_OVERLAP``, as for any other script. ``--model qwen3_5_moe`` trains a Qwen3.5-MoE model
instead (the ``qwen3_5_moe`` preset), whose MoE blocks have a shared expert with a sigmoid gate.

    torchrun --nproc_per_node 2 train_trainer.py --zero-stage 1
    deepspeed --num_gpus 8 train_trainer.py --autoep-size 8

The model (tiny dimensions, random initialisation: nothing is downloaded) and a synthetic corpus are built
here, deterministically. ``--report FILE`` makes rank 0 write, as JSON, the loss of every step and, for every
router and expert parameter of the converted model, the largest absolute change over the run on any rank and
the smallest fraction of its elements that changed on any rank, the transport and overlap the AutoEP layers
use, and, where the config sets ``expert_parallel.load_balance_coeff``, each layer's routing bias and whether every
rank holds the same; the example's test checks that each of them trained.
"""

import argparse
import json
import os

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

HERE = os.path.dirname(os.path.abspath(__file__))
PAD_ID = 0


def parse_args():
    parser = argparse.ArgumentParser(description="AutoEP fine-tuning of a small Qwen3-MoE with transformers' Trainer")
    parser.add_argument("--output-dir", default="build/trainer-demo")
    parser.add_argument("--deepspeed-config", default=os.path.join(HERE, "ds_config_trainer.json"))
    parser.add_argument("--zero-stage", type=int, default=None, help="override the config's zero_optimization.stage")
    parser.add_argument("--autoep-size", type=int, default=None, help="override expert_parallel.autoep_size")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--model",
                        choices=("qwen3_moe", "qwen3_5_moe"),
                        default="qwen3_moe",
                        help="the model (and AutoEP preset): Qwen3-MoE, or Qwen3.5-MoE with a gated shared expert")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--report", default=None, help="rank 0 writes losses and router/expert changes here")
    return parser.parse_args()


class SyntheticCorpus(torch.utils.data.Dataset):
    """Fixed-length sequences of a sparse random Markov chain: each token has four likely successors."""

    def __init__(self, num_sequences, vocab_size, seq_len, seed):
        g = torch.Generator().manual_seed(seed)
        successors = torch.randint(1, vocab_size, (vocab_size, 4), generator=g)
        probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
        tokens = torch.empty(num_sequences, seq_len, dtype=torch.long)
        tokens[:, 0] = torch.randint(1, vocab_size, (num_sequences, ), generator=g)
        for t in range(1, seq_len):
            choice = torch.multinomial(probs.expand(num_sequences, 4), 1, generator=g).squeeze(1)
            tokens[:, t] = successors[tokens[:, t - 1], choice]
        self.tokens = tokens

    def __len__(self):
        return self.tokens.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def is_router_or_expert(name):
    """Parameters of the MoE blocks: what AutoEP replaces (the experts' weights and the router's gate), and the
    shared experts it runs alongside (Qwen3.5-MoE's shared expert and its gate)."""
    return ".experts." in name or ".router." in name or ".shared_expert" in name


class ChangeReport(TrainerCallback):
    """Records each step's loss, and how far every router and expert parameter moved during training.

    The snapshot is taken in ``on_train_begin``, after ``deepspeed.initialize`` has converted the model, so it
    holds the AutoEP layers' own parameters (each rank's local experts). ZeRO-3 is not supported here: its
    parameters are partitioned and would need gathering.
    """

    def __init__(self):
        self.before = {}
        self.losses = []
        self.max_change = {}
        self.changed_fraction = {}
        self.transports = []
        self.overlaps = []
        self.routing_biases = {}
        self.biases_agree = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # The expert all-to-all transport each AutoEP layer resolved at set-up (config, environment or `auto`).
        layers = [m for m in model.modules() if type(m).__name__ == "AutoEPMoELayer"]
        self.transports = sorted({str(getattr(m, "comm_backend", None)) for m in layers})
        self.overlaps = sorted({str(getattr(m, "comm_overlap", None)) for m in layers})
        self.before = {
            name: p.detach().float().clone()
            for name, p in model.named_parameters() if is_router_or_expert(name)
        }

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])

    def on_train_end(self, args, state, control, model=None, **kwargs):
        import deepspeed.comm as dist
        params = dict(model.named_parameters())
        names = sorted(self.before)
        deltas = [(params[n].detach().float() - self.before[n]).abs() for n in names]
        change = torch.tensor([d.max().item() for d in deltas])
        fraction = torch.tensor([(d > 0).float().mean().item() for d in deltas])
        # Each rank holds different experts: the largest change of each parameter on any rank, and the smallest
        # fraction of its elements that changed on any rank (an expert that never trains shows up there).
        dist.all_reduce(change, op=dist.ReduceOp.MAX)
        dist.all_reduce(fraction, op=dist.ReduceOp.MIN)
        self.max_change = dict(zip(names, change.tolist()))
        self.changed_fraction = dict(zip(names, fraction.tolist()))
        # load_balance_coeff's routing biases: every rank must hold the same, bit for bit.
        biased = [(name, m) for name, m in model.named_modules() if getattr(m, "routing_bias", None) is not None]
        if biased:
            biases = torch.cat([m.routing_bias.detach().float().cpu() for _, m in biased])
            highest, lowest = biases.clone(), biases.clone()
            dist.all_reduce(highest, op=dist.ReduceOp.MAX)
            dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
            self.biases_agree = bool(torch.equal(highest, lowest))
            self.routing_biases = {name: m.routing_bias.tolist() for name, m in biased}


def build_model(args):
    """The tiny model ``--model`` names, with random weights."""
    import transformers
    common = dict(vocab_size=256,
                  hidden_size=args.hidden_size,
                  num_hidden_layers=2,
                  num_attention_heads=4,
                  num_key_value_heads=2,
                  head_dim=args.hidden_size // 4,
                  num_experts=args.num_experts,
                  num_experts_per_tok=args.top_k,
                  moe_intermediate_size=64,
                  max_position_embeddings=args.seq_len,
                  pad_token_id=PAD_ID,
                  use_cache=False)
    if args.model == "qwen3_5_moe":
        config = transformers.Qwen3_5MoeTextConfig(shared_expert_intermediate_size=128,
                                                   layer_types=["full_attention"] * common["num_hidden_layers"],
                                                   **common)
        return transformers.Qwen3_5MoeForCausalLM(config)
    config = transformers.Qwen3MoeConfig(intermediate_size=128, decoder_sparse_step=1, **common)
    return transformers.Qwen3MoeForCausalLM(config)


def main():
    args = parse_args()
    torch.manual_seed(args.seed)  # every rank builds the same initial weights
    model = build_model(args)
    config = model.config

    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    ds_config["expert_parallel"]["preset_model"] = args.model
    if args.zero_stage is not None:
        ds_config["zero_optimization"]["stage"] = args.zero_stage
    if args.autoep_size is not None:
        ds_config["expert_parallel"]["autoep_size"] = args.autoep_size

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    micro_batch = 2
    training_args = TrainingArguments(output_dir=args.output_dir,
                                      deepspeed=ds_config,
                                      per_device_train_batch_size=micro_batch,
                                      max_steps=args.steps,
                                      learning_rate=2e-3,
                                      weight_decay=0.01,
                                      warmup_steps=2,
                                      bf16=True,
                                      logging_steps=1,
                                      save_strategy="no",
                                      report_to=[],
                                      disable_tqdm=True,
                                      dataloader_num_workers=0,
                                      seed=args.seed,
                                      use_cpu=not torch.cuda.is_available())  #ignore-cuda
    corpus = SyntheticCorpus(args.steps * micro_batch * world_size, config.vocab_size, args.seq_len, args.seed)
    report = ChangeReport()
    trainer = Trainer(model=model, args=training_args, train_dataset=corpus, callbacks=[report])
    trainer.train()

    if args.report and trainer.is_world_process_zero():
        with open(args.report, "w") as f:
            json.dump(
                {
                    "losses": report.losses,
                    "max_change": report.max_change,
                    "changed_fraction": report.changed_fraction,
                    "transports": report.transports,
                    "overlaps": report.overlaps,
                    "routing_biases": report.routing_biases,
                    "biases_agree": report.biases_agree,
                },
                f,
                indent=1)


if __name__ == "__main__":
    main()
