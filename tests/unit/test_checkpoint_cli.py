"""``python -m hp_lightning.checkpoint`` and :class:`ResumableLoader`, without a process group.

The round trip from a real 4-rank HSDP checkpoint is in tests/distributed/test_checkpoint_resume.py;
here the command line's own behaviour: outputs, exit codes, messages.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from hp_lightning.checkpoint import ResumableLoader, save_checkpoint
from hp_lightning.checkpoint.__main__ import main


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    path = tmp_path / "src.ckpt"
    weights = {"net.w": torch.randn(6, 4), "net.b": torch.randn(6), "head.w": torch.randn(2, 6)}
    optimizer = {
        "state": {name: {"step": torch.tensor(3.0), "exp_avg": torch.randn_like(w)} for name, w in weights.items()},
        "param_groups": [{"lr": 0.01, "params": list(weights)}],
    }
    checkpoint = {
        "state_dict": weights,
        "optimizer_states": [optimizer],
        "global_step": 3,
        "pytorch-lightning_version": "2.6.6",
        "hyper_parameters": {"width": 6},
        "loops": {"fit_loop": {}},
    }
    save_checkpoint(checkpoint, path, sharded=True)
    return path


def _tensors(obj: object, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _tensors(value, f"{prefix}/{key}").items()}
    if isinstance(obj, list):
        return {k: v for i, value in enumerate(obj) for k, v in _tensors(value, f"{prefix}/{i}").items()}
    return {}


def test_consolidate_shard_round_trip_is_identical(sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    first, back, second = tmp_path / "one.ckpt", tmp_path / "back", tmp_path / "two.ckpt"
    assert main(["consolidate", str(sharded), str(first)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["shard", str(first), str(back)]) == 0
    assert main(["consolidate", str(back), str(second)]) == 0
    a, b = torch.load(first, weights_only=False), torch.load(second, weights_only=False)
    assert a["global_step"] == b["global_step"] == 3 and a["hyper_parameters"] == {"width": 6}
    ta, tb = _tensors({"s": a["state_dict"], "o": a["optimizer_states"]}), _tensors({"s": b["state_dict"], "o": b["optimizer_states"]})
    assert ta.keys() == tb.keys() and len(ta) == 3 + 6
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert a["optimizer_states"][0]["param_groups"][0]["params"] == ["net.w", "net.b", "head.w"]


def test_weights_only_and_safetensors_exports(sharded: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    full, light, safe = tmp_path / "full.ckpt", tmp_path / "light.ckpt", tmp_path / "w.safetensors"
    assert main(["consolidate", str(sharded), str(full)]) == 0
    assert main(["consolidate", str(sharded), str(light), "--weights-only"]) == 0
    assert main(["consolidate", str(sharded), str(safe), "--format", "safetensors"]) == 0
    whole, weights = torch.load(full, weights_only=False), torch.load(light, weights_only=False)
    assert "optimizer_states" not in weights and "loops" not in weights
    assert weights["hyper_parameters"] == {"width": 6}
    assert light.stat().st_size < full.stat().st_size
    tensors = load_file(str(safe))
    assert tensors.keys() == whole["state_dict"].keys()
    assert all(torch.equal(tensors[k], whole["state_dict"][k]) for k in tensors)


def test_verify_reports_the_damaged_file(sharded: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", str(sharded)]) == 0
    assert "OK" in capsys.readouterr().out
    shard = next(sharded.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    assert main(["verify", str(sharded)]) == 1
    err = capsys.readouterr().err
    assert shard.name in err and "truncated" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["consolidate", "{file}", "{tmp}/o.ckpt"], "already a single-file checkpoint"),
        (["shard", "{src}", "{tmp}/o"], "is a directory; shard reads single-file checkpoints"),
        (["consolidate", "{src}", "{src}"], "is the source checkpoint itself"),
        (["consolidate", "{tmp}/missing", "{tmp}/o.ckpt"], "does not exist"),
    ],
)
def test_bad_arguments_exit_1_with_a_message(sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str], message: str) -> None:
    file = tmp_path / "file.ckpt"
    assert main(["consolidate", str(sharded), str(file)]) == 0
    capsys.readouterr()
    argv = [a.format(file=file, tmp=tmp_path, src=sharded) for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"hp-lightning-checkpoint {argv[0]}: error:") and message in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["consolidate", "only_one_arg"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["consolidate", "a", "b", "--format", "onnx"])
    assert info.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_python_dash_m_entry_point(sharded: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli.ckpt"
    run = subprocess.run([sys.executable, "-m", "hp_lightning.checkpoint", "consolidate", str(sharded), str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"wrote {out}") and out.is_file()


# ---------------------------------------------------------------- ResumableLoader


def test_resumable_loader_continues_the_epoch() -> None:
    data = list(range(20))
    first = ResumableLoader(DataLoader(data, batch_size=4))
    batches = iter(first)
    seen = [next(batches).tolist() for _ in range(2)]
    state = first.state_dict()
    assert state == {"batches_served": 2, "batches_per_epoch": 5}
    resumed = ResumableLoader(DataLoader(data, batch_size=4))
    resumed.load_state_dict(state)
    assert resumed.state_dict()["batches_served"] == 2  # a save before the next batch keeps the position
    rest = [b.tolist() for b in resumed]
    assert seen + rest == [list(range(i, i + 4)) for i in range(0, 20, 4)]
    assert [b.tolist() for b in resumed][0] == [0, 1, 2, 3]  # the next epoch starts at the beginning


def test_resumable_loader_at_the_end_of_an_epoch_starts_the_next() -> None:
    loader = ResumableLoader(DataLoader(list(range(8)), batch_size=4))
    loader.load_state_dict({"batches_served": 2, "batches_per_epoch": 2})
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_resumable_loader_forwards_attributes_and_refuses_bad_state() -> None:
    inner = DataLoader(list(range(8)), batch_size=2)
    loader = ResumableLoader(inner)
    assert loader.batch_size == 2 and loader.dataset is inner.dataset
    loader.worker_init_fn = print
    assert inner.worker_init_fn is print
    with pytest.raises(ValueError, match="had 3 batches per rank, this loader has 4"):
        loader.load_state_dict({"batches_served": 1, "batches_per_epoch": 3})
    with pytest.raises(TypeError, match="needs a loader with a length"):
        ResumableLoader(iter(range(3)))
    plain = ResumableLoader([["a"], ["b"], ["c"]])  # any sized iterable: skipped by reading
    plain.load_state_dict({"batches_served": 1, "batches_per_epoch": 3})
    assert list(plain) == [["b"], ["c"]]


def test_plain_pytorch_checkpoint_sharded_and_loaded_by_position(tmp_path: Path) -> None:
    """Optimizer state keyed by position (plain PyTorch / single-device Lightning) survives shard and load."""
    from hp_lightning.checkpoint import load_checkpoint

    def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    source, optimizer = model_and_optimizer(0)
    for _ in range(2):
        source(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    native = optimizer.state_dict()
    assert isinstance(next(iter(native["state"])), int)
    full = tmp_path / "plain.ckpt"
    torch.save({"state_dict": source.state_dict(), "optimizer_states": [native], "global_step": 2, "pytorch-lightning_version": "2.6.6"}, full)
    assert main(["shard", str(full), str(tmp_path / "sharded")]) == 0
    for path in (full, tmp_path / "sharded"):
        target, target_optimizer = model_and_optimizer(1)
        rest = load_checkpoint(path, target, [target_optimizer])
        assert rest["global_step"] == 2 and "state_dict" not in rest
        assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))
        for p_source, p_target in zip(source.parameters(), target.parameters()):
            for key, value in optimizer.state[p_source].items():
                assert torch.equal(value, target_optimizer.state[p_target][key]), (path.name, key)
    # Consolidated back to one file, the state is keyed by position again: plain torch restores it.
    assert main(["consolidate", str(tmp_path / "sharded"), str(tmp_path / "back.ckpt")]) == 0
    back = torch.load(tmp_path / "back.ckpt", weights_only=False)["optimizer_states"][0]
    assert sorted(back["state"]) == sorted(native["state"])
    _, plain = model_and_optimizer(1)
    plain.load_state_dict(back)
    for p_source, p_plain in zip(source.parameters(), plain.param_groups[0]["params"]):
        assert torch.equal(optimizer.state[p_source]["exp_avg"], plain.state[p_plain]["exp_avg"])


def test_stateful_loader_resumed_mid_epoch_on_another_data_parallel_size_is_warned_about() -> None:
    from hp_lightning.checkpoint import DATA_PARALLEL_KEY, loader_resume_warning

    def checkpoint(dp: int, yielded: int, finished: bool = False) -> dict:
        loader = {"_num_yielded": yielded, "_iterator_finished": finished, "_sampler_iter_state": {"samples_yielded": 8 * yielded}}
        return {DATA_PARALLEL_KEY: dp, "loops": {"fit_loop": {"state_dict": {"combined_loader": [loader]}}}}

    assert loader_resume_warning(checkpoint(2, 3), 2) is None  # same size: torchdata continues exactly
    assert loader_resume_warning(checkpoint(2, 0), 4) is None  # nothing drawn yet this epoch
    assert loader_resume_warning(checkpoint(2, 3, finished=True), 4) is None
    assert loader_resume_warning({"loops": {}}, 4) is None  # no stateful loader
    message = loader_resume_warning(checkpoint(2, 3), 4)
    assert message is not None and "saved mid-epoch by 2 data-parallel ranks and resumes on 4" in message

