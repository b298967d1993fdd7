"""``python -m jaxflow.export --checkpoint RUN_DIR [--step N] [--role actor|critic] --out DIR``

Converts a saved step of a jaxflow run (default: the latest complete one; the last line names
the step) into an HF directory (``config.json``, ``*.safetensors``, the run's tokenizer) that
``transformers.AutoModelForCausalLM.from_pretrained`` loads (a critic:
``AutoModelForTokenClassification``): verl's model merger, for jaxflow. A LoRA run's actor
becomes a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``) that
``peft.PeftModel.from_pretrained`` loads onto the base model, or with ``--merged`` the HF
model with the adapters merged into its weights. Each step is read as
the config it was saved with describes it. The saved state is read shard by shard into the
role's training mesh (``jaxflow.num_devices`` simulated devices on CPU) and written one tensor
at a time; no device holds the whole model.

``--out`` must be a new or empty directory, or an earlier jaxflow export (which is then
replaced; an interruption leaves the old one or the new one in place, never neither). Any
other directory (``.``, ``~``, the run directory) is refused before anything is read.
"""

from __future__ import annotations

import argparse
import sys

from jaxflow.mesh.devices import simulate_devices


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxflow.export", description=__doc__.split("\n\n")[1])
    p.add_argument("--checkpoint", required=True, help="the run directory (trainer.default_local_dir)")
    p.add_argument("--step", type=int, default=None, help="the step to export (default: the latest complete one)")
    p.add_argument("--role", choices=("actor", "critic"), default="actor")
    p.add_argument(
        "--merged", action="store_true", help="a LoRA run: the HF model with the adapters merged in (not the adapter)"
    )
    p.add_argument(
        "--out", required=True, help="the HF directory to write: new, empty, or an earlier jaxflow export (replaced)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from jaxflow.models import CheckpointError
    from jaxflow.trainer.checkpoint import MARKER
    from jaxflow.trainer.hf_export import ExportError, export_checkpoint, step_config
    from jaxflow.trainer.outputs import storage_error

    try:
        step, cfg = step_config(args.checkpoint, args.step)  # the step's own config
        simulate_devices(cfg.jaxflow.num_devices)
        out = export_checkpoint(args.checkpoint, args.out, step=step, role=args.role, merged=args.merged)
    except (CheckpointError, OSError, ValueError, ExportError) as e:  # OSError: missing files, not ours, disk full
        print(f"error: {storage_error(e) or e}", file=sys.stderr)
        return 2
    except (KeyError, AttributeError) as e:  # a config.json from another jaxflow version lacks a key
        print(
            f"error: the config of {args.checkpoint} (its config.json, or the step's {MARKER}) lacks a key this "
            f"jaxflow reads ({type(e).__name__}: {e}); was it written by another jaxflow version?",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: the export to {args.out} was cut short; an earlier export there is kept", file=sys.stderr)
        return 130
    which = "the latest complete step" if args.step is None else "as asked"
    print(f"wrote {out}: the {args.role} of step {step} ({which}) of {args.checkpoint}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
