"""Peak memory of importing a Hugging Face checkpoint, per rank: does a rank hold only its shard?

    .venv/bin/python scripts/experiments/hf_import_memory.py [--layout 1,2,4] [--experts 32] [--d-model 256]

Writes a Mixtral-style checkpoint (fp32 safetensors) much larger than one rank's shard, then, for every
(pp_rank, ep_rank) of the layout, a fresh process builds that rank's shard, calls `hf.load_into_shard`
exactly as `parallelize` does, and reports its peak RSS during the load (VmHWM reset just before it)
over its RSS before the load (the shard's own parameters exist by then). The pages of the tensors read
through safetensors' mmap count as resident, so reading the whole file would show as its size. DP
replicas load the slice of their (pp, ep) twin; ranks run one after another (the load does no
communication). file/shard is at most pp*ep: a rank holds 1/pp of the layers and 1/ep of the experts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def status_bytes(field: str) -> int:
    """VmRSS (resident now) or VmHWM (peak resident since the last reset) of this process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS


def one_rank(hf_dir: str, pp: int, ep: int, pp_rank: int, ep_rank: int) -> dict:
    import torch

    from nanotitan.interop import hf
    from nanotitan.config.config import load_config
    from nanotitan.model.spec import build_chunk_specs
    from nanotitan.model.transformer import Transformer

    torch.set_num_threads(1)
    cfg = load_config(None, ["--init.from_hf", hf_dir, "--train.seq_len", "16", "--parallel.pp", str(pp),
                             "--parallel.ep", str(ep)])
    model = Transformer(cfg.model, build_chunk_specs(cfg, pp_rank, ep_rank)[0])
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    reset_peak()
    before = status_bytes("VmRSS")
    read = hf.load_into_shard(model, hf_dir)
    return {"pp_rank": pp_rank, "ep_rank": ep_rank, "shard_bytes": shard_bytes, "tensors_read": len(read),
            "load_peak_over_before": status_bytes("VmHWM") - before,
            "rss_after_minus_before": status_bytes("VmRSS") - before}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="1,2,4", help="dp,pp,ep")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        d, pp, ep, pr, er = args.child
        print(json.dumps(one_rank(d, int(pp), int(ep), int(pr), int(er))))
        return

    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from nanotitan.data.tokenizer import train_bpe

    dp, pp, ep = (int(x) for x in args.layout.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        config = MixtralConfig(vocab_size=512, hidden_size=args.d_model, intermediate_size=args.ffn,
                               num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                               num_local_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=64)
        with torch.device("cpu"):
            MixtralForCausalLM(config).save_pretrained(hf_dir)
        train_bpe(["some text to train a tokenizer on " * 20], 300).save(str(hf_dir / "tokenizer.json"))
        file_bytes = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))
        rows = []
        for pr in range(pp):
            for er in range(ep):
                out = subprocess.run([sys.executable, __file__, "--child", str(hf_dir), str(pp), str(ep), str(pr),
                                      str(er)], capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(out.stderr)
                out = out.stdout
                rows.append(json.loads(out.strip().splitlines()[-1]))
    mib = 2**20
    print(f"checkpoint {file_bytes / mib:.1f} MiB of safetensors; layout dp={dp} pp={pp} ep={ep}")
    print(f"{'pp':>3} {'ep':>3} {'shard MiB':>10} {'file/shard':>10} {'load peak MiB':>14} {'tensors read':>13}")
    for r in rows:
        print(f"{r['pp_rank']:>3} {r['ep_rank']:>3} {r['shard_bytes'] / mib:>10.1f} "
              f"{file_bytes / r['shard_bytes']:>10.1f} {r['load_peak_over_before'] / mib:>14.1f} "
              f"{r['tensors_read']:>13}")


if __name__ == "__main__":
    main()
