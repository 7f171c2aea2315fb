#!/usr/bin/env python3
"""TorchRec on CPU, the same DLRM step that `ftrec bench train --preset tiny` times.

What is matched (crates/ftrec-config/src/lib.rs `preset("tiny")`,
crates/ftrec-bench/src/train_step.rs, crates/ftrec-model/src/dlrm.rs, crates/ftrec-model/src/layers/{mlp,interaction}.rs):

- 26 tables x 100,000 rows x dim 64, one id per feature, sum pooling;
- bottom MLP 13-512-256-64 with ReLU on every layer, the dot interaction over the
  bottom output and the 26 pooled embeddings (64 + 26*27/2 = 415 wide, pairs i > j,
  self-products excluded), top MLP 415-512-256-1 with ReLU on all but the logit;
- mean binary cross-entropy on the logit; SGD lr 0.01 on the embeddings and on the
  dense parameters;
- batch 2048; eight batches made up front and cycled, so data loading is not timed:
  ids Zipf(1.1) over 1..=rows-1 per table, dense features uniform in [0, 5), labels
  Bernoulli(0.25) (the same distributions, not the same random numbers, as ftrec's
  Xoshiro generator);
- the timed step is the whole update: forward, backward, and both optimizers.

TorchRec's own `DLRM` module is that architecture (DenseArch / InteractionArch /
OverArch). The embeddings are a `FusedEmbeddingBagCollection` by default: fbgemm's CPU
table-batched kernels with SGD fused into the backward, which is how TorchRec trains
embeddings (a plain `EmbeddingBagCollection` with torch.optim.SGD would update all
26 x 100,000 rows every step). `--ebc plain` times that for reference.

Prints one JSON object with the keys `ftrec bench train --json` uses for the same figures.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0 = all cores, as ftrec)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dense", type=int, default=13)
    p.add_argument("--bottom", default="512,256,64")
    p.add_argument("--top", default="512,256,1")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ebc", choices=["fused", "plain"], default="fused")
    return p.parse_args()


def widths(text):
    return [int(w) for w in text.split(",") if w]


def zipf_sampler(torch, n, s):
    """Zipf(s) on 1..=n by inverse CDF: rand_distr's `Zipf::new(n, s)`, which ftrec uses."""
    k = torch.arange(1, n + 1, dtype=torch.float64)
    cdf = torch.cumsum(k.pow(-s), 0)
    cdf /= cdf[-1].clone()

    def sample(count, gen):
        u = torch.rand(count, dtype=torch.float64, generator=gen)
        return torch.searchsorted(cdf, u).clamp_(max=n - 1) + 1

    return sample


def make_batches(torch, KeyedJaggedTensor, a, keys, count=8):
    gen = torch.Generator().manual_seed(a.seed)
    zipf = zipf_sampler(torch, a.rows - 1, 1.1)
    batches = []
    for _ in range(count):
        dense = torch.rand(a.batch, a.dense, generator=gen) * 5.0
        labels = (torch.rand(a.batch, generator=gen) < 0.25).float()
        # KJT values are feature-major: every sample of table 0, then of table 1, ...
        ids = torch.cat([zipf(a.batch, gen) for _ in keys]).to(torch.int64)
        lengths = torch.ones(len(keys) * a.batch, dtype=torch.int32)
        sparse = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids, lengths=lengths)
        batches.append((dense, sparse, labels))
    return batches


def init_like_ftrec(torch, model, rows):
    """ftrec's DLRM-reference init: W ~ N(0, sqrt(2/(in+out))), b ~ N(0, sqrt(1/out)),
    rows uniform in +-sqrt(1/rows). Speed does not depend on it; it keeps the two runs'
    numbers (ReLU sparsity, loss) alike."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                out_f, in_f = m.weight.shape
                m.weight.normal_(0.0, (2.0 / (in_f + out_f)) ** 0.5)
                m.bias.normal_(0.0, (1.0 / out_f) ** 0.5)
        bound = (1.0 / rows) ** 0.5
        for name, param in model.named_parameters():
            if "embedding" in name:
                param.uniform_(-bound, bound)


def main():
    a = parse_args()
    import torch

    threads = a.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    # ftrec runs one rayon pool; inter-op parallelism would add threads beyond it.
    torch.set_num_interop_threads(1)
    torch.manual_seed(a.seed)

    import torchrec
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    bottom, top = widths(a.bottom), widths(a.top)
    if bottom[-1] != a.dim or top[-1] != 1:
        sys.exit("--bottom must end at --dim and --top at 1")
    keys = [f"t{t}" for t in range(a.tables)]
    tables = [
        EmbeddingBagConfig(
            name=f"table_{t}",
            embedding_dim=a.dim,
            num_embeddings=a.rows,
            feature_names=[k],
            pooling=PoolingType.SUM,
        )
        for t, k in enumerate(keys)
    ]
    device = torch.device("cpu")
    if a.ebc == "fused":
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

        ebc = FusedEmbeddingBagCollection(
            tables=tables,
            optimizer_type=torch.optim.SGD,
            optimizer_kwargs={"lr": a.lr},
            device=device,
        )
    else:
        ebc = torchrec.EmbeddingBagCollection(tables=tables, device=device)
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=a.dense,
        dense_arch_layer_sizes=bottom,
        over_arch_layer_sizes=top,
        dense_device=device,
    )
    init_like_ftrec(torch, model, a.rows)
    # The fused collection updates its tables inside backward; only the rest goes to SGD.
    dense_params = [
        p for n, p in model.named_parameters() if a.ebc == "plain" or "sparse_arch" not in n
    ]
    optimizer = torch.optim.SGD(dense_params, lr=a.lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    batches = make_batches(torch, KeyedJaggedTensor, a, keys)

    def step(batch):
        dense, sparse, labels = batch
        optimizer.zero_grad(set_to_none=True)
        logits = model(dense, sparse).squeeze(-1)
        loss = loss_fn(logits, labels)
        loss.backward()
        optimizer.step()
        return loss.item()

    times, losses = [], []
    for i in range(a.warmup + max(a.steps, 1)):
        t = time.perf_counter()
        losses.append(step(batches[i % len(batches)]))
        if i >= a.warmup:
            times.append((time.perf_counter() - t) * 1e3)
    times.sort()

    def pct(p):
        return times[round((len(times) - 1) * p)]

    median = pct(0.5)
    import fbgemm_gpu

    report = {
        "peer": "torchrec",
        "embedding": "FusedEmbeddingBagCollection" if a.ebc == "fused" else "EmbeddingBagCollection",
        "batch_size": a.batch,
        "threads": threads,
        "warmup_steps": a.warmup,
        "steps": len(times),
        "step_ms_median": median,
        "step_ms_p10": pct(0.1),
        "step_ms_p90": pct(0.9),
        "samples_per_sec": a.batch / (median / 1e3),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        # ru_maxrss is in KiB on Linux.
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torchrec": getattr(torchrec, "__version__", "unknown"),
            "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "unknown"),
        },
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
