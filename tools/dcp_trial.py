"""Trial of torch.distributed.checkpoint (DCP) with its Hugging Face safetensors storage for our FSDP state.

The question (issue 22, item 3): could DCP replace our own sharded checkpoint code? This saves the `tiny`
model's FSDP2 weights and AdamW state after two steps with ``HuggingFaceStorageWriter(save_distributed=True)``
(one safetensors file per rank, offsets in the header; non-tensor optimizer fields kept aside, as our JSON
state would hold them), then loads them with ``HuggingFaceStorageReader`` into a fresh model on any number of
processes and compares the next step's loss with the one the saving job computed::

    torchrun --nproc_per_node 2 tools/dcp_trial.py save /tmp/dcp    # writes the shards and next_loss.json
    torchrun --nproc_per_node 2 tools/dcp_trial.py load /tmp/dcp    # 2 -> 2
    torchrun --nproc_per_node 1 tools/dcp_trial.py load /tmp/dcp    # 2 -> 1 (save with 1 for 1 -> 2)
    python tools/dcp_trial.py lose /tmp/dcp                          # rank 0's piece of one tensor lost
    torchrun --nproc_per_node 1 tools/dcp_trial.py load /tmp/dcp    # ... and loaded anyway

Measured (torch 2.13.0+cpu, gloo, 2026-11-25): the next loss equals the saving job's bitwise for 2 -> 2,
2 -> 1 and 1 -> 2; no ``.metadata`` pickle is written or read. But after ``lose`` (rank 0's rows of
``blocks.0.attn.k_norm.weight`` left out of its file, header made to match, as a buggy writer would leave
it) the load succeeds without a word: the reader infers each tensor's size from the pieces it finds, the
missing rows keep the fresh model's values, and the next loss differs (4.658407 vs 4.658357). Our format
refuses such a checkpoint ("... do not cover ..."); see docs/architecture.md.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hybridnorm.config import ModelConfig


def flat_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list]:
    """Every tensor of the model and optimizer under one flat name (what DCP's HF storage can hold), and
    the optimizer's param_groups (plain numbers: our state.json's part)."""
    msd, osd = get_state_dict(model, opt)
    flat = {f"model.{k}": v for k, v in msd.items()}
    flat |= {f"optim.{fqn}.{n}": v for fqn, st in osd["state"].items() for n, v in st.items()}
    return flat, osd["param_groups"]


def lose_first_piece(path: Path, name: str = "model.blocks.0.attn.k_norm.weight") -> None:
    """Rewrite rank 0's file without its piece of ``name`` (tensors and DCP's sharding header alike)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    file = next(p for p in sorted(path.glob("shard-00001-*.safetensors")))
    with safe_open(str(file), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys() if k != name}
    info = json.loads(meta["DCP_SHARDING_INFO"])
    print(f"dropping {name} {info.pop(name)} from {file.name}")
    save_file(tensors, str(file), metadata={**meta, "DCP_SHARDING_INFO": json.dumps(info)})


def main(mode: str, path: Path) -> None:
    if mode == "lose":
        return lose_first_piece(path)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("tiny")
    model = cfg.build()
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, cfg.vocab_size, (4, 16), generator=gen) for _ in range(2))

    def step() -> float:
        opt.zero_grad()
        loss = model(x, targets=y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    if mode == "save":
        step(), step()
        flat, _ = flat_state(model, opt)
        dcp.save(flat, storage_writer=HuggingFaceStorageWriter(str(path), save_distributed=world > 1))
        following = step()
        if dist.get_rank() == 0:
            (path / "next_loss.json").write_text(json.dumps(following))
            print("files:", sorted(p.name for p in path.iterdir()))
    else:
        step()  # the optimizer state exists, then is overwritten
        flat, groups = flat_state(model, opt)
        dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(path)))
        msd = {k.removeprefix("model."): v for k, v in flat.items() if k.startswith("model.")}
        state: dict[str, dict[str, torch.Tensor]] = {}
        for k, v in flat.items():
            if k.startswith("optim."):
                fqn, name = k.removeprefix("optim.").rsplit(".", 1)
                state.setdefault(fqn, {})[name] = v
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict={"state": state, "param_groups": groups})
        got, want = step(), json.loads((path / "next_loss.json").read_text())
        print(f"rank {dist.get_rank()} of {world}: next loss {got!r}, saving job's {want!r}, equal: {got == want}")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], Path(sys.argv[2]))
