"""``python -m ddp_template.export CKPT OUT``: a checkpoint's model weights as one file, for
inference: the model's ``state_dict`` by name, whole, whether the checkpoint holds them whole
(``parallel=ddp``) or sliced into a file per rank (``parallel=fsdp2``). ``--ema``: the averaged
weights instead. Load it with ``model.load_state_dict(torch.load(OUT))`` on any machine, no
process group, no DCP.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ddp_template.checkpoint import checkpoint_file, load, save_atomic, whole
from ddp_template.errors import ConfigError, command

FIX = "pass a checkpoint of a run, e.g. outputs/<run id>/checkpoints/last.pt"


def export(ckpt: str, out: str, *, ema: bool = False) -> str:
    """Write ``ckpt``'s model (or EMA) weights to ``out`` (each a path or an object's URL);
    what was written, in one line."""
    ckpt = checkpoint_file(ckpt, said="checkpoint ", fix=FIX)
    payload = load(ckpt, fix=FIX)
    keys = ("ema", "model") if ema else ("model",)
    state = whole(ckpt, payload, *keys)
    if state is None:
        held = (
            "no EMA weights (it was written without ema.decay); drop --ema"
            if ema
            else (f"no model weights; {FIX}")
        )
        raise ConfigError(f"checkpoint {ckpt} holds {held}.")
    state = {name: t.detach().clone() for name, t in state.items()}  # no views of a larger file
    save_atomic(state, out)
    count = sum(t.numel() for t in state.values() if t.is_floating_point())
    layout = "sliced, a file per rank" if "slices" in payload else "whole"
    return (
        f"{out}: {len(state)} tensors, {count:,} parameters and buffers of "
        f"{'the EMA' if ema else 'the model'} of {ckpt} (held {layout})"
    )


@command
def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ddp_template.export", description=__doc__)
    parser.add_argument("ckpt", help="a checkpoint (.pt) of a run: a path or s3://…")
    parser.add_argument("out", help="the file to write (a state_dict): a path or s3://…")
    parser.add_argument("--ema", action="store_true", help="the EMA's weights")
    args = parser.parse_args(argv)
    print(export(args.ckpt, args.out, ema=args.ema))


if __name__ == "__main__":
    sys.exit(main())
