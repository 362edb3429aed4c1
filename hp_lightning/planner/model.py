"""What the planner plans for: the user's model, built on the meta device, and one micro-batch for it.

A model is a class path with init args (a ``LightningModule``, built as the Trainer builds it, or
a plain ``nn.Module``), a LightningCLI YAML (its ``model:`` section), or a Hugging Face config
(object, dict or ``config.json``: the causal LM ``AutoModelForCausalLM.from_config`` builds).
Everything is built under ``torch.device("meta")``, so an 8B model plans on a laptop. Plain modules
and Hugging Face models are wrapped in :class:`CausalLMModule`, which ``--validate`` trains too.
"""

from __future__ import annotations

import importlib
import json
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import yaml
from torch import Tensor, nn
from typing_extensions import override


class ModelBuildError(ValueError):
    """The model cannot be built on the meta device (or named as given)."""


def _import(path: str) -> Any:
    module_path, _, name = path.rpartition(".")
    if not module_path:
        raise ModelBuildError(f"Model class path {path!r} has no module part; expected 'package.module.Class', e.g. 'examples.gpt.GPTLightningModule'.")
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise ModelBuildError(f"Model class path {path!r}: module {module_path!r} does not import ({exc}). Check the path and PYTHONPATH.") from exc
    if not hasattr(module, name):
        raise ModelBuildError(f"Model class path {path!r}: {module_path!r} has no attribute {name!r}.")
    return getattr(module, name)


def _logits_loss(output: Any, target: Tensor) -> Tensor:
    """Next-token cross-entropy for ``(B, T, V)`` logits; the mean of anything else (a stand-in loss)."""
    if hasattr(output, "logits"):
        output = output.logits
    if isinstance(output, (tuple, list)):
        output = output[0]
    if output.dim() == 3 and output.shape[:2] == target.shape:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))
    return output.float().mean()


class CausalLMModule(pl.LightningModule):
    """A ``LightningModule`` around a Hugging Face causal LM config or a plain ``nn.Module`` class.

    The inner model is built in ``configure_model`` (on the meta device under ``HSDPStrategy``),
    trained on ``(input_ids, targets)`` batches with next-token cross-entropy and AdamW.

    Args:
        hf_config: a Hugging Face config as a dict (``model_type`` included); or None.
        class_path / init_args: a plain ``nn.Module`` class and its arguments; or None.
        learning_rate: AdamW's learning rate.
    """

    def __init__(
        self,
        hf_config: dict[str, Any] | None = None,
        class_path: str | None = None,
        init_args: dict[str, Any] | None = None,
        learning_rate: float = 1e-3,
    ) -> None:
        super().__init__()
        if (hf_config is None) == (class_path is None):
            raise ValueError("CausalLMModule needs exactly one of hf_config (a dict) or class_path (a dotted nn.Module class).")
        self.hf_config = hf_config
        self.class_path = class_path
        self.init_args = dict(init_args or {})
        self.learning_rate = learning_rate
        self.model: nn.Module | None = None

    @override
    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.hf_config is not None:
            from transformers import AutoConfig, AutoModelForCausalLM

            config = dict(self.hf_config)
            config_obj = AutoConfig.for_model(config.pop("model_type"), **config)
            self.model = AutoModelForCausalLM.from_config(config_obj)
        else:
            self.model = _import(str(self.class_path))(**self.init_args)

    @override
    def forward(self, idx: Tensor) -> Any:
        assert self.model is not None, "call configure_model() first"
        return self.model(idx)

    def pipeline_loss(self, output: Any, target: Tensor) -> Tensor:
        return _logits_loss(output, target)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        return self.pipeline_loss(self(inputs), targets)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


@dataclass(frozen=True)
class ModelSpec:
    """How to build the model: a ``LightningModule`` class path and its init args (plain models wrapped).

    Attributes:
        class_path: the LightningModule class (:class:`CausalLMModule` for Hugging Face configs and plain modules).
        init_args: its keyword arguments.
        label: what the user named (for reports).
        strategy_args: strategy init args found alongside (a LightningCLI YAML's ``tp_plan``, ...).
        data_args: the YAML's ``data:`` init args (batch size, block size), as defaults for the batch.
    """

    class_path: str
    init_args: Mapping[str, Any] = field(default_factory=dict)
    label: str = ""
    strategy_args: Mapping[str, Any] = field(default_factory=dict)
    data_args: Mapping[str, Any] = field(default_factory=dict)

    def build(self) -> pl.LightningModule:
        """The LightningModule with its model built, every tensor on the meta device.

        Raises:
            ModelBuildError: the class does not import, its arguments are wrong, or building it
                needs real tensors (it reads values or allocates outside the meta device).
        """
        cls = _import(self.class_path)
        where = f"{self.label or self.class_path}"
        try:
            with torch.device("meta"), no_warnings():
                module = cls(**dict(self.init_args))
                if isinstance(module, pl.LightningModule):
                    module.configure_model()
        except TypeError as exc:
            raise ModelBuildError(f"Building {where} with init args {dict(self.init_args)} failed: {exc}. Check the argument names.") from exc
        except (RuntimeError, NotImplementedError) as exc:
            raise ModelBuildError(
                f"{where} cannot be built on the meta device: {type(exc).__name__}: {exc}. The planner never allocates the "
                f"model; its __init__/configure_model must not read tensor values (e.g. .item(), torch.load) while building. "
                f"Move such code to a hook that runs after setup, or initialize in reset_parameters()."
            ) from exc
        if not isinstance(module, pl.LightningModule):
            raise ModelBuildError(f"{where} is a {type(module).__name__}, not an nn.Module / LightningModule.")
        if not any(True for _ in module.parameters()):
            raise ModelBuildError(f"{where} has no parameters after __init__ and configure_model(); nothing to plan.")
        return module

    def vocab_size(self, module: nn.Module) -> int:
        """The token vocabulary, for the batch of token ids (init args, hparams or an HF config).

        Raises:
            ModelBuildError: none found (the planner plans token-id language models).
        """
        candidates: list[Any] = [self.init_args.get("vocab_size"), (self.init_args.get("hf_config") or {}).get("vocab_size")]
        candidates.append(getattr(getattr(module, "hparams", {}), "get", lambda _k: None)("vocab_size"))
        candidates += [getattr(getattr(sub, "config", None), "vocab_size", None) for sub in module.modules()]
        for value in candidates:
            if isinstance(value, int) and value > 0:
                return value
        raise ModelBuildError(
            f"{self.label or self.class_path}: no vocab_size found (init args, hparams or a .config). The planner feeds "
            f"token ids (micro-batch x sequence length); give the model a vocab_size argument or config."
        )


def _wrap_plain(class_path: str, init_args: Mapping[str, Any], label: str) -> ModelSpec:
    cls = _import(class_path)
    if isinstance(cls, type) and issubclass(cls, pl.LightningModule):
        return ModelSpec(class_path, dict(init_args), label=label)
    if isinstance(cls, type) and issubclass(cls, nn.Module):
        return ModelSpec(
            "hp_lightning.planner.model.CausalLMModule", {"class_path": class_path, "init_args": dict(init_args)}, label=label
        )
    raise ModelBuildError(f"{class_path!r} is not an nn.Module or LightningModule class; got {cls!r}.")


def hf_config_dict(config: Any) -> dict[str, Any]:
    """A Hugging Face config (object, dict or ``config.json`` path) as the dict :class:`CausalLMModule` takes.

    Raises:
        ModelBuildError: no ``model_type`` (the architecture cannot be chosen without it).
    """
    if isinstance(config, (str, Path)):
        config = json.loads(Path(config).read_text())
    if hasattr(config, "to_diff_dict"):
        data = config.to_diff_dict()
        data["model_type"] = config.model_type
        config = data
    if not isinstance(config, Mapping) or "model_type" not in config:
        raise ModelBuildError(f"A Hugging Face config needs 'model_type' (e.g. 'llama'); got keys {sorted(config)[:10] if isinstance(config, Mapping) else type(config).__name__}.")
    drop = {"architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype", "auto_map"}
    return {k: v for k, v in dict(config).items() if k not in drop}


def from_yaml(path: str | Path, model_class: str | None = None) -> ModelSpec:
    """The model a LightningCLI YAML trains (its ``model:`` section), with its strategy and data args.

    Raises:
        ModelBuildError: no ``model:`` section, or no class to build it with.
    """
    text = Path(path).read_text()
    config = yaml.safe_load(text) or {}
    model = config.get("model")
    if not isinstance(model, Mapping):
        raise ModelBuildError(f"{path}: no 'model:' section; the planner builds the model the LightningCLI config trains.")
    class_path = model.get("class_path", model_class)
    init_args = dict(model.get("init_args", {} if "class_path" in model else model))
    if class_path is None:
        raise ModelBuildError(
            f"{path}: 'model:' has no class_path (the CLI fixes the model class in code). Pass it: "
            f"--model-class examples.gpt.GPTLightningModule."
        )
    data = config.get("data") or {}
    data_args = dict(data.get("init_args", data)) if isinstance(data, Mapping) else {}
    data_args.pop("class_path", None)
    if "block_size" in data_args and "block_size" not in init_args and class_path.endswith("GPTLightningModule"):
        init_args["block_size"] = data_args["block_size"]  # examples/train.py links data.block_size to the model's
    strategy = ((config.get("trainer") or {}).get("strategy")) or {}
    strategy_args = dict(strategy.get("init_args", {})) if isinstance(strategy, Mapping) else {}
    spec = _wrap_plain(class_path, init_args, label=f"{path} ({class_path})")
    return ModelSpec(spec.class_path, spec.init_args, spec.label, strategy_args, data_args)


def resolve_model(model: Any, init_args: Mapping[str, Any] | None = None, *, model_class: str | None = None) -> ModelSpec:
    """Turn whatever names the model into a :class:`ModelSpec` (see the module docstring).

    Args:
        init_args: the class's arguments (class paths and classes only).
        model_class: the model class of a YAML whose ``model:`` section has no ``class_path``.

    Raises:
        ModelBuildError: nothing buildable recognized.
    """
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, type):
        return _wrap_plain(f"{model.__module__}.{model.__qualname__}", init_args or {}, label=model.__name__)
    if isinstance(model, Mapping) or (hasattr(model, "model_type") and hasattr(model, "to_dict")):
        data = hf_config_dict(model)
        return ModelSpec("hp_lightning.planner.model.CausalLMModule", {"hf_config": data}, label=f"HF {data['model_type']} config")
    if isinstance(model, (str, Path)):
        text = str(model)
        if text.endswith((".yaml", ".yml")):
            return from_yaml(text, model_class)
        if text.endswith(".json"):
            data = hf_config_dict(text)
            return ModelSpec("hp_lightning.planner.model.CausalLMModule", {"hf_config": data}, label=f"{text} ({data['model_type']})")
        return _wrap_plain(text, init_args or {}, label=text)
    raise ModelBuildError(
        f"Cannot plan for {type(model).__name__} {model!r}: expected a class path ('examples.gpt.GPTLightningModule'), a "
        f"LightningCLI YAML, a Hugging Face config (object, dict or config.json), or a class."
    )


@contextmanager
def no_warnings() -> Iterator[None]:
    """Warnings ignored inside (Python 3.10 has no ``warnings.catch_warnings(action=...)``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def step_loss(module: pl.LightningModule, batch: tuple[Tensor, Tensor]) -> Tensor:
    """The loss of one micro-batch as the Trainer computes it (``training_step``; ``self.log``'s warning without a Trainer silenced)."""
    with no_warnings():
        out = module.training_step(batch, 0)
    loss = out["loss"] if isinstance(out, Mapping) else out
    if not isinstance(loss, Tensor):
        raise ModelBuildError(f"{type(module).__name__}.training_step returned {type(out).__name__}, not a loss tensor (or a dict with 'loss').")
    return loss
