"""LightningCLI: every config in examples/configs is parsed into the strategy it describes, and trains.

Every config is parsed and instantiated in this process (``run=False``) and its options, mesh and
callbacks checked. The configs whose combination no distributed test builds also train end to end:
``examples/train.py``'s ``main`` with the config, run on warm gloo ranks (2 or 4 CPU processes),
the model and corpus shrunk on the command line so each run takes seconds. One run goes through
``python examples/train.py`` itself, where Lightning's launcher starts the other rank.
"""

from __future__ import annotations

import csv
import inspect
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

import hp_lightning.callbacks
from hp_lightning import HSDPStrategy
from tests.helpers import run_script_in_ranks

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "configs"
TRAIN = REPO / "examples" / "train.py"
CONFIG_NAMES = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
#: A model and corpus small enough for seconds per run; the configs' other settings are kept.
TINY = [
    "--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--data.max_chars=20000",
    "--data.batch_size=4", "--data.val_windows=16", "--trainer.limit_val_batches=1",
    "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.log_every_n_steps=1",
]


def load_config(name: str) -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())


def strategy_args(config: dict[str, Any]) -> dict[str, Any]:
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == "hp_lightning.HSDPStrategy"
    return strategy.get("init_args", {})


def checkpoint_meta(root: Path) -> tuple[Path, dict[str, Any]]:
    """The newest sharded checkpoint directory under ``root`` and its ``meta.pt``."""
    metas = sorted(root.rglob("meta.pt"), key=lambda p: p.stat().st_mtime)
    assert metas, f"no sharded checkpoint under {root}: {sorted(str(p) for p in root.rglob('*'))[:20]}"
    return metas[-1].parent, torch.load(metas[-1], map_location="cpu", weights_only=False)


def logged(root: Path, key: str) -> list[float]:
    """Every value of ``key`` in the CSVLogger's metrics.csv under ``root``."""
    files = list(root.rglob("metrics.csv"))
    assert len(files) == 1, files
    with files[0].open() as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]


# ------------------------------------------------------------------ parsing (one process, nothing launched)


def test_full_options_sets_every_strategy_option():
    keyword_only = {
        name for name, p in inspect.signature(HSDPStrategy.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY
    }
    assert set(strategy_args(load_config("full_options"))) == keyword_only


def test_the_cli_reads_every_strategy_option_with_type_default_and_help():
    """What LightningCLI (jsonargparse) sees of both front ends: every option, typed, with its default and its field docstring."""
    from jsonargparse._parameter_resolvers import get_signature_parameters

    from hp_lightning.core.options import HSDPOptions, field_docs, input_types
    from hp_lightning.fabric import HSDPFabricStrategy

    docs, types = field_docs(), input_types()
    defaults = {f.name: f.default for f in __import__("dataclasses").fields(HSDPOptions)}
    for cls in (HSDPStrategy, HSDPFabricStrategy):
        params = {p.name: p for p in get_signature_parameters(cls)}
        assert set(types) <= set(params), set(types) - set(params)
        for name in types:
            p = params[name]
            assert p.annotation == types[name] and p.default == defaults[name], name
            assert p.doc and " ".join(p.doc.split()) == docs[name], name


def test_full_options_uses_every_callback():
    classes = {
        name for name in hp_lightning.callbacks.__all__
        if isinstance(getattr(hp_lightning.callbacks, name), type) and issubclass(getattr(hp_lightning.callbacks, name), Callback)
    }
    used = {c["class_path"].rpartition(".")[2] for c in load_config("full_options")["trainer"]["callbacks"]}
    assert classes <= used, f"callbacks missing from full_options.yaml: {sorted(classes - used)}"


def test_yaml_values_reach_the_strategy():
    """Strings for dtypes, name patterns for parameter sets, a mapping, seconds: each arrives typed."""
    from examples.gpt import CharDataModule, GPTLightningModule
    from examples.train import GPTCLI

    cli = GPTCLI(GPTLightningModule, CharDataModule, run=False, args=["--config", str(CONFIGS / "full_options.yaml")])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, HSDPStrategy)
    assert tuple(strategy.options.mesh_shape) == (2, 2)
    assert strategy.options.param_dtype is torch.bfloat16 and strategy.options.reduce_dtype is torch.float32
    assert strategy.options.ignored_params == ["model.pos_emb.weight"]
    assert strategy.options.replicate_params == ["model.ln_f.*", "*.ln_attn.*", "*.ln_mlp.*"]
    assert strategy.options.shard_placement == {"*.mlp.proj.weight": 1}
    assert strategy.options.activation_checkpointing == ["model.blocks.*"]
    assert strategy.options.shard_modules == ["examples.gpt.Block"]
    assert strategy.options.comm_fusion is True and strategy.options.reduce_op == "avg" and strategy.options.prefetch == 1
    assert strategy.options.gradient_scaling_factor == 1.0 and strategy.options.forward_methods == ["sample_text"]
    assert strategy.state_dict_type == "sharded" and strategy.process_group_backend == "gloo"
    assert strategy.options.timeout.total_seconds() == 1800
    kinds = {type(c).__name__: c for c in cli.trainer.callbacks}
    assert kinds["GradientAccumulationSync"].mode == "defer_all_reduce"
    assert kinds["ReshardSchedule"].validate is False
    assert cli.model.hparams.block_size == cli.datamodule.hparams.block_size == 64  # linked


@pytest.mark.parametrize(
    ("init_args", "message"),
    [({"reduce_op": "max"}, "reduce_op"), ({"prefetch": -1}, "expects an int >= 0"), ({"param_dtype": "int8"}, "param_dtype")],
    ids=["literal", "validated", "dtype"],
)
def test_bad_strategy_option_in_yaml_is_refused(tmp_path, capsys, init_args, message):
    from examples.gpt import CharDataModule, GPTLightningModule
    from examples.train import GPTCLI

    config = {"trainer": {"accelerator": "cpu", "devices": 2, "strategy": {"class_path": "hp_lightning.HSDPStrategy", "init_args": init_args}}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    # Type errors stop the parser (SystemExit, message on stderr); the strategy's own checks raise
    # from its constructor while jsonargparse instantiates it (ValueError naming the option).
    with pytest.raises((SystemExit, ValueError)) as error:
        GPTCLI(GPTLightningModule, CharDataModule, run=False, args=["--config", str(path)])
    if isinstance(error.value, SystemExit):
        assert error.value.code != 0
    assert message in str(error.value) + capsys.readouterr().err


# ------------------------------------------------------------------ training runs (real processes)


def expected_mesh(config: dict[str, Any]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The mesh a config asks for, worked out from its YAML alone (names outermost first, sizes)."""
    trainer_cfg = config["trainer"]
    world = trainer_cfg["devices"] * trainer_cfg.get("num_nodes", 1)
    init_args = strategy_args(config)
    mesh_shape = list(init_args["mesh_shape"])
    tp, ep = init_args.get("tensor_parallel_size", 1), init_args.get("expert_parallel_size", 1)
    pp = init_args.get("pipeline_parallel_size", 1)
    replicate = mesh_shape[0] if len(mesh_shape) == 2 else None
    shard = mesh_shape[-1] if mesh_shape[-1] != -1 else world // tp // pp // (replicate or 1)
    dims: list[tuple[str, int]] = [("pp", pp)] if pp > 1 else []
    dims += [("replicate", replicate)] if replicate else []
    dims += [("expert_shard", shard // ep), ("ep", ep)] if ep > 1 else [("shard", shard)]
    dims += [("tp", tp)] if tp > 1 else []
    return tuple(n for n, _ in dims), tuple(s for _, s in dims)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_config_is_parsed_into_the_strategy_it_describes(name, monkeypatch):
    """Every config, parsed and instantiated as ``fit`` would (``run=False``): options, mesh, callbacks."""
    monkeypatch.setattr(sys, "argv", ["train.py"])  # LightningCLI reads args=..., not pytest's own
    from examples.gpt import CharDataModule, GPTLightningModule
    from examples.train import GPTCLI
    from hp_lightning.core.mesh import resolve_layout

    config = load_config(name)
    cli = GPTCLI(GPTLightningModule, CharDataModule, run=False, args=["--config", str(CONFIGS / f"{name}.yaml")])
    strategy = cli.trainer.strategy
    assert type(strategy) is HSDPStrategy
    # YAML and the Python constructor give the same options, every one of them (typed the same way).
    init_args = strategy_args(config)
    assert strategy.options.settings() == HSDPStrategy(**init_args).options.settings()
    trainer_cfg = config["trainer"]
    world = trainer_cfg["devices"] * trainer_cfg.get("num_nodes", 1)
    assert strategy.num_processes * strategy.num_nodes == world
    assert cli.trainer.accumulate_grad_batches == trainer_cfg.get("accumulate_grad_batches", 1)
    options = strategy.options
    layout = resolve_layout(
        options.mesh_shape, world_size=world, num_nodes=strategy.num_nodes, devices_per_node=strategy.num_processes,
        tensor_parallel_size=options.tensor_parallel_size, expert_parallel_size=options.expert_parallel_size,
        pipeline_parallel_size=options.pipeline_parallel_size,
    )
    assert (layout.names, layout.shape) == expected_mesh(config)
    assert layout.world_size == world
    configured = [c["class_path"].rpartition(".")[2] for c in trainer_cfg.get("callbacks", [])]
    present = {type(c).__name__ for c in cli.trainer.callbacks}
    assert set(configured) <= present, (configured, present)


#: Trained end to end (3 optimizer steps, the tiny model). The other configs are parsed and checked
#: above, and the distributed tests train their paths: FSDP/HSDP parity and checkpoints
#: (test_parity, test_checkpoint_resume), the three accumulation modes against one process
#: (test_callbacks), CPU offload (test_strategy_options). These four combine options or models no
#: distributed test builds: every option and callback at once on HSDP 2x2 (full_options), the
#: example GPT cut into pipeline stages (fsdp_pp), its tensor-parallel plan (fsdp_tp) and its MoE
#: blocks under expert parallelism on HSDP (hsdp_ep).
TRAINED_CONFIGS = ["full_options", "fsdp_pp", "fsdp_tp", "hsdp_ep"]


def _train_config(name: str, out: str) -> dict[str, Any]:
    """On each warm rank: ``examples/train.py fit --config <name>`` as the CLI runs it, in ``out``."""
    os.chdir(out)
    sys.argv = ["train.py"]  # LightningCLI reads args=..., not the test runner's own
    from examples.train import main

    config = load_config(name)
    steps, accumulate = 3, config["trainer"].get("accumulate_grad_batches", 1)
    pp = strategy_args(config).get("pipeline_parallel_size", 1)
    args = ["fit", "--config", str(CONFIGS / f"{name}.yaml"), f"--trainer.max_steps={steps}",
            f"--trainer.val_check_interval={steps * accumulate}", *TINY, *(["--model.n_layer=4"] if pp > 1 else [])]
    cli = main(args)
    return {"global_step": cli.trainer.global_step, "world": cli.trainer.world_size}


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED_CONFIGS)
def test_config_trains(tmp_path, name):
    from tests.helpers import run_distributed

    config = load_config(name)
    trainer_cfg = config["trainer"]
    world = trainer_cfg["devices"] * trainer_cfg.get("num_nodes", 1)
    accumulate = trainer_cfg.get("accumulate_grad_batches", 1)
    steps = 3
    results = run_distributed(_train_config, world, name, str(tmp_path), timeout=300)
    assert [r["global_step"] for r in results] == [steps] * world and {r["world"] for r in results} == {world}

    # The run went through HSDPStrategy: the checkpoint is a sharded directory, one file per rank,
    # and it recorded exactly `steps` optimizer steps of `accumulate` micro-batches.
    directory, meta = checkpoint_meta(tmp_path)
    assert len(list(directory.glob("*.distcp"))) == world
    assert meta["global_step"] == steps
    progress = meta["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"]
    assert progress == steps * accumulate
    # Loss was computed and synchronized: finite training losses and one finite validation loss.
    losses = logged(tmp_path, "train_loss")
    assert len(losses) >= steps and all(math.isfinite(v) for v in losses)
    val = logged(tmp_path, "val_loss")
    assert len(val) == 1 and math.isfinite(val[0]) and 3.0 < val[0] < 5.0  # ~ln(96) = 4.56 after 3 steps
    # The sharding report shows the mesh the config asked for.
    report = next(tmp_path.rglob("sharding.txt")).read_text()
    names, shape = expected_mesh(config)
    expected = ", ".join(f"{n}={s}" for n, s in zip(names, shape))
    assert expected in report.splitlines()[0], report
    if strategy_args(config).get("cpu_offload"):
        assert "cpu" in report.splitlines()[3].split()  # the offload column of the first unit


@pytest.mark.slow
def test_strategy_name_on_the_command_line(tmp_path):
    args = ["fit", "--trainer.strategy=hsdp", "--trainer.accelerator=cpu", "--trainer.devices=2",
            "--trainer.max_steps=2", "--trainer.val_check_interval=2", "--trainer.default_root_dir=run", *TINY]
    run_script_in_ranks(TRAIN, args, tmp_path, 2)  # the CLI is the subject; Lightning's launcher is test_launchers'
    saved = yaml.safe_load(next(tmp_path.rglob("config.yaml")).read_text())
    assert saved["trainer"]["strategy"] == "hsdp"
    directory, meta = checkpoint_meta(tmp_path / "run")
    assert len(list(directory.glob("*.distcp"))) == 2 and meta["global_step"] == 2


def test_configuration_reference_covers_every_option_and_callback():
    text = (REPO / "docs" / "configuration.md").read_text()
    options = [n for n, p in inspect.signature(HSDPStrategy.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY]
    callbacks = [c["class_path"].rpartition(".")[2] for c in load_config("full_options")["trainer"]["callbacks"] if c["class_path"].startswith("hp_lightning")]
    missing = [name for name in [*options, *callbacks, *CONFIG_NAMES] if f"`{name}" not in text]
    assert not missing, f"docs/configuration.md does not document {missing}"
