"""The speed levers: ``compile`` per block, selective activation checkpointing, on a Hugging Face Llama.

One launch of 4 gloo ranks, a tiny ``LlamaForCausalLM`` built in ``configure_model`` (meta
device), ``accumulate_grad_batches=2``. Eager HSDP 2 x 2 is the reference. Compiled runs use a
backend that counts each graph it is handed and runs it eagerly: the numbers stay eager's (so the
comparison is tight) while dynamo captures, guards and recompiles exactly as under inductor. After
the warm-up step, no graph is compiled again (no recompile per micro-batch or per
``set_requires_gradient_sync`` toggle). A compiled run's checkpoint has the eager run's keys and
resumes in an eager run. Activation checkpointing, ``"full"`` on every block and ``"selective_op"``
on every second block, trains with the same losses as none.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything

from tests.helpers import run_distributed, trainer_kwargs

WORLD = 4
STEPS = 4
VOCAB, LENGTH = 64, 8

COMPILED_GRAPHS: list[int] = []


def counting_backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """A ``torch.compile`` backend that records each graph it is given and runs it eagerly."""
    COMPILED_GRAPHS.append(len(graph.graph.nodes))
    return graph.forward


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )


class LitLlama(LightningModule):
    def configure_model(self) -> None:
        from transformers import LlamaForCausalLM

        self.net = LlamaForCausalLM(llama_config())

    def training_step(self, batch, batch_idx):
        ids, target = batch
        logits = self.net(ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class UserCompiled(LitLlama):
    """Compiles the model itself in ``configure_model`` and names pretrained weights there (loaded while materializing)."""

    def __init__(self, how: str, weights: str) -> None:
        super().__init__()
        self.how, self.weights = how, weights

    def configure_model(self) -> None:
        import hp_lightning

        super().configure_model()
        if self.how == "wrapper":
            self.net = torch.compile(self.net, backend=counting_backend)  # names carry "_orig_mod."
        else:
            self.net.compile(backend=counting_backend)  # in place
        hp_lightning.load_weights(self, self.weights, prefix="net.")

    def on_fit_start(self) -> None:
        embed = dict(self.named_parameters())[f"net.{'_orig_mod.' if self.how == 'wrapper' else ''}model.embed_tokens.weight"]
        self.loaded_embed = embed.full_tensor().clone()



class Recorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.graphs_after_step: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.graphs_after_step.append(len(COMPILED_GRAPHS))
        if "train_loss" in trainer.callback_metrics:
            self.losses.append(float(trainer.callback_metrics["train_loss"]))


def _loader():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (64, LENGTH), generator=g)
    data = torch.utils.data.TensorDataset(ids, (3 * ids + 1) % VOCAB)
    return torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)


def _fit(ckpt: str | None = None, save_dir: str | None = None, steps: int = STEPS, model: Any = None, **options: Any) -> dict:
    """A fit of ``steps`` optimizer steps; with ``save_dir``, a checkpoint ``at4.ckpt`` after step 4."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    import hp_lightning

    seed_everything(0)
    COMPILED_GRAPHS.clear()
    recorder = Recorder()
    model = model or LitLlama()
    options.setdefault("mesh_shape", [2, 2])
    callbacks: list[Callback] = [recorder]
    if save_dir:
        callbacks.append(ModelCheckpoint(dirpath=save_dir, filename="at4", every_n_train_steps=4, save_top_k=-1))
    trainer = Trainer(devices=WORLD, strategy=hp_lightning.HSDPStrategy(**options), max_steps=steps, accumulate_grad_batches=2,
                      callbacks=callbacks, limit_val_batches=0, **trainer_kwargs(enable_checkpointing=bool(save_dir)))
    trainer.fit(model, _loader(), ckpt_path=ckpt)
    if isinstance(model, UserCompiled):
        out = Path(save_dir or ".") / f"hf_{model.how}"
        trainer.strategy.save_hf(out, prefix="net.", config=model.weights)
        trained = dict(model.named_parameters())[f"net.{'_orig_mod.' if model.how == 'wrapper' else ''}model.embed_tokens.weight"]
        return {"loaded": model.loaded_embed, "trained": trained.full_tensor(), "exported": str(out),
                "keys": sorted(trainer.strategy.lightning_module_state_dict())}
    return {
        "losses": recorder.losses,
        "graphs": recorder.graphs_after_step,
        "keys": sorted(trainer.strategy.lightning_module_state_dict()),
        "forward": type(model.net.model.layers[0].forward).__name__,
    }


def worker(tmp: str) -> dict:
    compiled = {"backend": counting_backend}
    eager_dir, compiled_dir = str(Path(tmp) / "eager"), str(Path(tmp) / "compiled")
    out = {
        "eager": _fit(save_dir=eager_dir, steps=STEPS + 2),
        "compiled": _fit(compile=compiled, save_dir=compiled_dir, steps=STEPS + 2),
        "fsdp_compiled": _fit(compile=compiled, mesh_shape=[WORLD], accumulation_mode="every"),
        "fsdp_eager": _fit(mesh_shape=[WORLD], accumulation_mode="every"),
        # Each run's step-4 checkpoint resumed by the other kind, to step 6.
        "compiled_to_eager": _fit(ckpt=str(Path(compiled_dir) / "at4.ckpt"), steps=STEPS + 2),
        "eager_to_compiled": _fit(ckpt=str(Path(eager_dir) / "at4.ckpt"), steps=STEPS + 2, compile=compiled),
    }
    # The user compiles the model in configure_model and loads Hugging Face weights there.
    import os

    weights, marker = Path(tmp) / "pretrained", Path(tmp) / "pretrained.done"
    if int(os.environ.get("RANK", "0")) == 0:
        from transformers import LlamaForCausalLM

        torch.manual_seed(5)
        LlamaForCausalLM(llama_config()).save_pretrained(weights)
        marker.touch()
    while not marker.exists():
        time.sleep(0.05)
    for how in ("wrapper", "in_place"):
        out[f"user_{how}"] = _fit(model=UserCompiled(how, str(weights)), save_dir=str(Path(tmp) / how), steps=1)
    if int(os.environ.get("RANK", "0")) == 0:
        from safetensors.torch import load_file
        from transformers import LlamaForCausalLM

        out["file_embed"] = load_file(str(weights / "model.safetensors"))["model.embed_tokens.weight"]
        for how in ("wrapper", "in_place"):
            out[f"exported_{how}"] = LlamaForCausalLM.from_pretrained(out[f"user_{how}"]["exported"]).model.embed_tokens.weight.detach()
    blocks = ["net.model.layers.*"]
    # Selective checkpointing on every second block: both levers in one fit (the other block runs plain).
    for mode, every in (("full", 1), ("selective_op", 2)):
        out[f"ac_{mode}_{every}"] = _fit(activation_checkpointing=blocks, activation_checkpointing_mode=mode, activation_checkpointing_every=every)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_distributed(worker, WORLD, str(tmp_path_factory.mktemp("speed")), timeout=500)


def test_compiled_blocks_train_like_eager_without_recompiling(results):
    for res in results:
        for eager, compiled in (("eager", "compiled"), ("fsdp_eager", "fsdp_compiled")):
            assert len(res[compiled]["losses"]) == len(res[compiled]["graphs"]) > 0  # one per micro-batch
            assert res[compiled]["losses"] == pytest.approx(res[eager]["losses"], rel=1e-6, abs=1e-6), compiled
            graphs = res[compiled]["graphs"]
            # Graphs are captured in the first window only, never after it. (The FSDP run, later in
            # the same process, may reuse the graphs dynamo cached for the HSDP run: same code, same guards.)
            assert graphs[2:] == [graphs[1]] * (len(graphs) - 2), graphs
        assert res["compiled"]["graphs"][0] > 0, res["compiled"]["graphs"]
        assert res["eager"]["graphs"] == [0] * len(res["eager"]["graphs"])


def test_compiled_checkpoint_has_eager_keys_and_resumes_in_eager_and_back(results):
    for res in results:
        assert res["compiled"]["keys"] == res["eager"]["keys"]
        assert not any("_orig_mod" in key for key in res["compiled"]["keys"])
        last_two_steps = res["eager"]["losses"][2 * STEPS :]  # micro-batch losses of steps 5 and 6
        assert len(last_two_steps) == 4
        for run in ("compiled_to_eager", "eager_to_compiled"):
            assert res[run]["losses"] == pytest.approx(last_two_steps, rel=1e-6, abs=1e-6), run


def test_a_model_the_user_compiles_loads_exports_and_checkpoints_under_its_own_names(results):
    file_embed = results[0]["file_embed"]
    for res in results:
        for how in ("wrapper", "in_place"):
            run = res[f"user_{how}"]
            assert torch.equal(run["loaded"], file_embed), how  # load_weights(prefix="net.") reached the compiled model
            assert run["keys"] == res["eager"]["keys"], how  # no "_orig_mod." in checkpoints
            if "exported_wrapper" in res:
                assert torch.equal(res[f"exported_{how}"], run["trained"]), how


def test_activation_checkpointing_modes_equal_none(results):
    for res in results:
        for run in ("ac_full_1", "ac_selective_op_2"):
            assert res[run]["losses"] == pytest.approx(res["eager"]["losses"][: 2 * STEPS], rel=1e-6, abs=1e-6), run
