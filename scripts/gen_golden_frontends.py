"""Write ``tests/golden/frontends.json``: what both front ends accept and resolve, for a refactor to keep.

For the Trainer and the Fabric strategy classes: the ``__init__`` signature (names, kinds,
defaults, resolved annotations; keyword-only options by name). For every registered strategy name and every YAML in
``examples/configs/``, on both front ends: the options every rank compares
(``options.settings()``), the sharding plan (no process group needed) and the mesh layout
(names and shape) for the world the YAML (or a 2 x 4 cluster) describes.
``tests/unit/test_golden_frontends.py`` recomputes it and asserts identity.

    .venv/bin/python scripts/gen_golden_frontends.py          # rewrite the golden file
    .venv/bin/python scripts/gen_golden_frontends.py --check  # exit 1 when it differs
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "frontends.json"
CONFIGS = ROOT / "examples" / "configs"
#: The world for registered names (no YAML to say it): 2 nodes of 4 devices.
REGISTRY_WORLD = {"num_nodes": 2, "devices": 4}


def _plain(value: Any) -> Any:
    """A JSON value that changes exactly when ``value`` does (repr for anything but containers and scalars)."""
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__name__, **{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    return repr(value)


def signature(cls: type) -> list[dict[str, Any]]:
    """Positional parameters in order, then the keyword-only ones by name (their order means nothing to a call)."""
    hints = typing.get_type_hints(cls.__init__)
    out = []
    params = list(inspect.signature(cls.__init__).parameters.items())
    keyword_only = sorted((item for item in params if item[1].kind is inspect.Parameter.KEYWORD_ONLY), key=lambda item: item[0])
    for name, p in [item for item in params if item[1].kind is not inspect.Parameter.KEYWORD_ONLY] + keyword_only:
        out.append(
            {
                "name": name,
                "kind": p.kind.name,
                "default": None if p.default is inspect.Parameter.empty else _plain(p.default),
                "annotation": repr(hints.get(name)) if name in hints else None,
            }
        )
    return out


def front_ends() -> dict[str, type]:
    import hp_lightning  # noqa: F401  (registers the names)
    from hp_lightning.fabric import HSDPStrategy as FabricStrategy
    from hp_lightning.strategies import HSDPStrategy as TrainerStrategy

    return {"trainer": TrainerStrategy, "fabric": FabricStrategy}


def resolved(front_end: str, cls: type, init_args: dict[str, Any], precision: Any, world: dict[str, int]) -> dict[str, Any]:
    """What ``cls(**init_args)`` resolves to: settings, sharding plan, mesh layout (or the error)."""
    import torch

    from hp_lightning.core.mesh import resolve_layout

    try:
        strategy = cls(**init_args)
    except (TypeError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    options = strategy.options
    out: dict[str, Any] = {"settings": _plain(options.settings())}
    if front_end == "trainer":
        from hp_lightning.strategies.precision import HSDPPrecision

        strategy.precision_plugin = HSDPPrecision(precision)
    else:
        from hp_lightning.fabric.precision import HSDPPrecision as FabricPrecision

        strategy.precision = FabricPrecision(precision)
    strategy.parallel_devices = [torch.device("cpu")] * world["devices"]
    plan = strategy.sharding_plan()
    # The plan is the options (in "settings" above) and the two policies they resolve to for this run.
    out["sharding_plan"] = {"mp_policy": _plain(plan.mp_policy), "offload_policy": _plain(plan.offload_policy)}
    try:
        layout = resolve_layout(
            options.mesh_shape,
            world_size=world["num_nodes"] * world["devices"],
            num_nodes=world["num_nodes"],
            devices_per_node=world["devices"],
            tensor_parallel_size=options.tensor_parallel_size,
            expert_parallel_size=options.expert_parallel_size,
            pipeline_parallel_size=options.pipeline_parallel_size,
        )
        out["layout"] = {"names": list(layout.names), "shape": list(layout.shape), "dp": list(layout.dp)}
    except ValueError as exc:
        out["layout"] = {"error": str(exc)}
    return out


def golden() -> dict[str, Any]:
    import yaml
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    classes = front_ends()
    registries = {"trainer": StrategyRegistry, "fabric": FABRIC_REGISTRY}
    out: dict[str, Any] = {"signatures": {fe: signature(cls) for fe, cls in classes.items()}, "registered": {}, "configs": {}}
    for fe, registry in registries.items():
        for name in ("hsdp", "hp_fsdp", "hsdp_cpu_offload"):
            entry = registry[name]
            init_args = dict(entry["init_params"])
            out["registered"][f"{fe}:{name}"] = {
                "init_params": _plain(init_args),
                "class_is_front_end": entry["strategy"] is classes[fe],
                **resolved(fe, classes[fe], init_args, "32-true", REGISTRY_WORLD),
            }
    for path in sorted(CONFIGS.glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        trainer = config["trainer"]
        init_args = trainer["strategy"].get("init_args", {})
        world = {"num_nodes": trainer.get("num_nodes", 1), "devices": trainer["devices"]}
        for fe, cls in classes.items():
            out["configs"][f"{fe}:{path.name}"] = resolved(fe, cls, dict(init_args), trainer.get("precision", "32-true"), world)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the golden file instead of writing it")
    args = parser.parse_args()
    text = json.dumps(golden(), indent=1, sort_keys=True) + "\n"
    if args.check:
        same = GOLDEN.exists() and GOLDEN.read_text() == text
        print("golden file up to date" if same else f"{GOLDEN} differs from the code")
        return 0 if same else 1
    GOLDEN.write_text(text)
    print(f"wrote {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
