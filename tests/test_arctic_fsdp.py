"""FSDP2 training (``examples/train_fsdp.py`` under torchrun, ``arctic.apply_fsdp``).

- Step-1 gradients and the 10-step loss trajectory equal single-device training of the same
  model on the same data, at dp=1 x sp=2 and dp=2 x sp=2, with activation checkpointing on
  (the default; the run's stage report is checked), with the checkpointed layer inputs
  offloaded to the host, and (slow) without checkpointing.
- A run stopped after 3 steps and resumed from its DCP checkpoint to 6 reproduces the
  uninterrupted run's losses: exactly at SP=2 on 2 ranks, within 1e-5 at SP=4 on 4 ranks.
- A DeepSpeed config that asks for ZeRO is refused on every rank before training.
- ``apply_fsdp`` refuses ZeRO-partitioned or already-sharded models, and a stage applied
  after it (the tiled MLP) is refused.
- ``offload_policy=CPUOffloadPolicy(pin_memory=False)`` reaches every FSDP unit, and training
  with it gives the same losses and parameters as without it, on 2 ranks and in the job
  (``--offload-params``); anything but an ``OffloadPolicy`` is refused before any collective.
  On gloo CPU ranks the host is the device, so the offload moves nothing: these tests check
  that the policy is applied and changes no numbers, not the host-device copies.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dist_pool
import launch_pool
from helpers import count_collectives, get_mesh
from helpers import value_error_of as _error

pytest.importorskip("transformers", reason="the FSDP2 job trains a HF model ([hf])")

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
SEQ_LEN, STEPS, LR = 64, 10, 1e-3
# fp32 throughout. Ulysses attention (CPU flash kernels, sums split over ranks) and FSDP2's
# reduce-scatter reorder floating-point sums against the single-device model. Measured on
# CPU: step-1 gradients differ by <= 1.2e-7 absolute, losses over 10 Adam steps by <= 1.2e-7
# relative; the bounds leave 8x and 80x. A gradient off by the SP factor is 50% off.
LOSS_RTOL = 1e-5
GRAD_TOL = dict(atol=1e-6, rtol=1e-5)


def _examples_common():
    """examples/_common.py as a module: the model and data the FSDP job uses."""
    spec = importlib.util.spec_from_file_location("examples_common",
                                                  REPO / "examples" / "_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torchrun(nproc: int, args: list[str], timeout: float = 240, seq_len: int = SEQ_LEN,
              launcher: tuple[str, ...] = (), env: dict = ENV) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           *launcher, "examples/train_fsdp.py", "--seq-len", str(seq_len), "--lr", str(LR)] + args
    if launcher:  # a launcher's own options: the real launch
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)
    return launch_pool.run(cmd, cwd=REPO, env=env, timeout=timeout)


def _train(tmp: Path, nproc: int, args: list[str],
           seq_len: int = SEQ_LEN) -> tuple[dict[int, dict], str]:
    """Run the job; returns (step -> log record, stdout). A step logged twice (replayed after
    a resume) keeps its last record."""
    log = tmp / "log.jsonl"
    proc = _torchrun(nproc, args + ["--log-file", str(log)], seq_len=seq_len)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r["step"]: r for r in map(json.loads, log.read_text().splitlines())}, proc.stdout


def _reference(dp: int, steps: int, seq_len: int,
               model_name: str = "tiny-llama") -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-device training of the same model (``model_name``: the job's ``--model``) on the
    same samples.

    Step k of the job trains dp rank r on the k-th sample of its ``DistributedSampler``
    (shuffled, seed 0, split over the dp axis only), and FSDP2's mean over the ranks makes
    the step's gradient the mean of the dp samples' gradients. Here: the same samples, loss
    = the mean of their per-sequence token-mean losses. Returns the losses (computed before
    each step, as the job logs them) and the first step's gradients.
    """
    from torch.utils.data import DistributedSampler

    train = _examples_common()
    torch.manual_seed(0)
    model = train.build_model(model_name, seq_len)
    data = train.ByteCorpus(REPO / "examples" / "data" / "corpus.txt", seq_len)
    samplers = [DistributedSampler(data, num_replicas=dp, rank=r, shuffle=True, seed=0)
                for r in range(dp)]
    orders = [list(s) for s in samplers]  # epoch 0; STEPS is far below one epoch
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, grads = [], None
    for k in range(steps):
        ids = torch.stack([data[order[k]]["input_ids"] for order in orders])  # [dp, S]
        loss = sum(model(input_ids=ids[r:r + 1], labels=ids[r:r + 1]).loss
                   for r in range(dp)) / dp
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads


@pytest.fixture(scope="module")
def dp1_sp2_run(tmp_path_factory):
    """The default job (activation checkpointing on) on 2 ranks; shared by two tests."""
    tmp = tmp_path_factory.mktemp("dp1_sp2")
    records, out = _train(tmp, 2, ["--sequence-parallel-size", "2", "--max-steps", str(STEPS),
                                   "--dump-grads", str(tmp / "grads.pt")])
    return records, out, torch.load(tmp / "grads.pt")


def _check_parity(records, grads, dp: int, seq_len: int = SEQ_LEN) -> None:
    ref_losses, ref_grads = _reference(dp, STEPS, seq_len)
    assert sorted(records) == list(range(1, STEPS + 1))
    losses = [records[k]["loss"] for k in range(1, STEPS + 1)]
    assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL, abs=0), (losses, ref_losses)
    assert set(grads) == set(ref_grads)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], **GRAD_TOL, msg=lambda m: f"{n}: {m}")
    ref_norm = torch.stack([g.norm() for g in ref_grads.values()]).norm().item()
    assert records[1]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)


def test_dp1_sp2_matches_single_device_with_checkpointing(dp1_sp2_run):
    records, out, grads = dp1_sp2_run
    assert "applied: sp_attention -> tiling -> checkpointing -> sharding (dp=1, sp=2)" in out
    _check_parity(records, grads, dp=1)


# dp=2 x sp=2 runs with the layer inputs offloaded to the host. At 256 tokens each rank's
# [1, 128, 128] fp32 layer input is 64 KiB, the offload's smallest size
# (offload.DEFAULT_MIN_OFFLOAD_BYTES); at 64 tokens nothing would move.
AC = "sp_attention -> tiling -> checkpointing -> sharding"
CASES = [
    pytest.param(4, ["--offload-activations"], 256, f"{AC} (dp=2, sp=2)", id="dp2_sp2_offload"),
    pytest.param(4, [], SEQ_LEN, f"{AC} (dp=2, sp=2)", id="dp2_sp2", marks=pytest.mark.slow),
    pytest.param(2, ["--no-activation-checkpointing"], SEQ_LEN,
                 "sp_attention -> tiling -> sharding (dp=1, sp=2)", id="dp1_sp2_no_checkpointing",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("nproc,extra,seq_len,stages", CASES)
def test_matches_single_device(tmp_path, nproc, extra, seq_len, stages):
    records, out = _train(tmp_path, nproc, ["--sequence-parallel-size", "2", "--max-steps",
                                            str(STEPS), "--dump-grads",
                                            str(tmp_path / "grads.pt")] + extra, seq_len)
    assert f"applied: {stages}" in out
    if "--offload-activations" in extra:
        assert all(r["offloaded_mib"] > 0 for r in records.values()), records
    _check_parity(records, torch.load(tmp_path / "grads.pt"), dp=nproc // 2, seq_len=seq_len)


def test_tiled_layer_and_seq_chunk_under_fsdp2_match_single_device(tmp_path):
    """The ulysses block's tiled_layer (each layer's tail as one tiled unit) and seq_chunk
    (sequence blocks inside each head chunk, fused projections) under FSDP2, dp=1 x sp=2,
    with checkpointing: the single-device losses and gradients."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"sequence_parallel_size": 2, "ulysses": {
        "head_chunk_size": 1, "fuse_projections": True, "seq_chunk": 2, "tiled_mlp": 2,
        "tiled_layer": True, "activation_checkpointing": True}}))
    records, out = _train(tmp_path, 2, ["--config", str(config), "--max-steps", str(STEPS),
                                        "--dump-grads", str(tmp_path / "grads.pt")])
    assert f"applied: {AC} (dp=1, sp=2)" in out
    _check_parity(records, torch.load(tmp_path / "grads.pt"), dp=1)


def test_offload_params_job_matches_run_without_it(dp1_sp2_run, tmp_path):
    records, out = _train(tmp_path, 2, ["--sequence-parallel-size", "2", "--max-steps", "3",
                                        "--offload-params"])
    assert "offload: parameters, gradients and optimizer state on the host " \
           "(CPUOffloadPolicy(pin_memory=False))" in out, out
    # CPU ranks: nothing moves, the same kernels run in the same order, so the losses agree
    # bit for bit with the run without the flag.
    assert {k: r["loss"] for k, r in records.items()} == \
           {k: r["loss"] for k, r in dp1_sp2_run[0].items() if k <= 3}


def test_stopped_run_resumes_step_for_step(dp1_sp2_run, tmp_path):
    uninterrupted = {k: r["loss"] for k, r in dp1_sp2_run[0].items() if k <= 6}
    common = ["--sequence-parallel-size", "2", "--save-dir", str(tmp_path / "ckpt"),
              "--save-every", "3"]
    first, _ = _train(tmp_path, 2, common + ["--max-steps", "3"])
    assert sorted(first) == [1, 2, 3] and (tmp_path / "ckpt" / "step3" / ".metadata").is_file()
    shutil.copytree(tmp_path / "ckpt", tmp_path / "sp4" / "ckpt")
    (tmp_path / "ckpt" / "step6").mkdir()  # a save that did not finish: no .metadata
    resumed, out = _train(tmp_path, 2, common + ["--max-steps", "6", "--resume"])
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert f"resumed from {tmp_path / 'ckpt' / 'step3'} (step 3)" in out, out[-3000:]
    assert f"skipped {tmp_path / 'ckpt' / 'step6'}: its save did not finish" in out, out[-3000:]
    # Same machine, same kernels, same reduction order: the trajectory is reproduced exactly.
    assert {k: r["loss"] for k, r in resumed.items()} == uninterrupted
    # At another layout: SP=4 on 4 ranks, resharded by DCP, the same samples (dp=1)
    sp4, _ = _train(tmp_path / "sp4", 4, ["--sequence-parallel-size", "4", "--save-dir",
                                           str(tmp_path / "sp4" / "ckpt"), "--save-every", "3",
                                           "--max-steps", "6", "--resume"])
    assert sorted(sp4) == [4, 5, 6]
    for k in (4, 5, 6):
        assert sp4[k]["loss"] == pytest.approx(uninterrupted[k], rel=1e-5, abs=0), k


@pytest.mark.slow  # the refusal itself: test_apply_fsdp_refuses_zero_and_stages_after_it
def test_zero_config_refused_on_every_rank_before_training(tmp_path):
    config = json.loads((REPO / "configs" / "cpu_demo.json").read_text())
    assert config["zero_optimization"]["stage"] == 3
    # torchrun stops the other ranks once one has failed; it looks every 3 s here (not every
    # 0.1 s), so that a rank a little behind on 2 busy cores still reaches its own refusal.
    proc = _torchrun(2, ["--config", str(REPO / "configs" / "cpu_demo.json"),
                         "--log-file", str(tmp_path / "log.jsonl")], timeout=120,
                     launcher=("--monitor-interval", "3"),
                     env={**ENV, "ARCTIC_TRACEBACK": "1"})  # every rank's own refusal
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    errors = [l for l in out.splitlines()
              if l.startswith("ValueError: FSDP2 and ZeRO cannot be mixed")]
    assert len(errors) == 2 and "zero_optimization.stage=3" in errors[0], out[-3000:]
    assert "applied:" not in out and not (tmp_path / "log.jsonl").exists()


def test_check_no_zero_accepts_stage_0_and_no_block():
    from arctic.train.fsdp import check_no_zero

    check_no_zero({"sequence_parallel_size": 2})
    check_no_zero({"zero_optimization": {"stage": 0}})
    for stage in (1, 2, 3):
        with pytest.raises(ValueError, match=f"FSDP2 and ZeRO cannot be mixed.*stage={stage}"):
            check_no_zero({"zero_optimization": {"stage": stage}})


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg)


def _rank_vocab_ends(tied: bool):
    import copy
    import traceback
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    import arctic
    from torch.distributed.tensor import DTensor
    from ulysses import SequenceParallelDims

    mesh = SequenceParallelDims(world_size=1, ulysses_degree=1).build_mesh("cpu")
    model = _tiny_llama()
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    reference = copy.deepcopy(model)
    ids = torch.arange(8)[None]
    reference(input_ids=ids).logits.sum().backward()
    arctic.apply_fsdp(model, mesh=mesh)
    units = sum(type(m).__name__.startswith("FSDP") for m in model.modules())
    gathered = {}

    def note(when):  # which weights are gathered (plain tensors, not DTensor shards)
        gathered[when] = {name: not isinstance(m.weight, DTensor) for name, m in
                          (("embed", model.model.embed_tokens), ("lm_head", model.lm_head),
                           ("norm", model.model.norm))}

    model.model.layers[0].register_full_backward_pre_hook(lambda *_: note("layer"))
    # the gradient of the embedding's output: its own backward comes next
    def before_the_embeddings_backward(module, args, out):
        out.register_hook(lambda grad: note("embed"))

    model.model.embed_tokens.register_forward_hook(before_the_embeddings_backward)
    # The lm_head's reduce-scatter buffers (FSDP2's foreach_reduce allocates the input, then
    # the output: here, one rank, the gradient shard) and which are alive when the last
    # decoder layer's backward starts
    buffers, alive = [], []

    class Reductions(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (func is torch.ops.aten.empty.memory_format
                    and out.numel() == model.lm_head.weight.numel()
                    and any(f.name == "foreach_reduce" for f in traceback.extract_stack())):
                buffers.append(weakref.ref(out))
            return out

    model.model.layers[-1].register_full_backward_pre_hook(
        lambda *_: alive.extend(ref() is not None for ref in buffers))
    logits = model(input_ids=ids).logits
    with Reductions():
        logits.sum().backward()
    grad = model.model.embed_tokens.weight.grad.full_tensor()
    return units, gathered, alive, torch.equal(grad, reference.model.embed_tokens.weight.grad)


def test_the_vocabulary_ends_are_units_freed_after_their_forward():
    """The embedding and the lm_head are sharded as units of their own: in the backward of a
    decoder layer neither is gathered (in the root, FSDP2 gathers them at the backward's
    start and keeps them, with the lm_head's whole gradient, to its end), and the embedding
    is not gathered for its own backward, which reads no weight (its gradient is still the
    unsharded model's). The final norm is a unit too, whose reduction releases the lm_head's
    reduce-scatter input before the last layer's backward (without it: alive through it).
    Tied, the three stay in the root."""
    untied, tied = (dist_pool.run(_rank_vocab_ends, t, world_size=1, timeout=120)[0]
                    for t in (False, True))
    apart = {"embed": False, "lm_head": False, "norm": False}
    # the lm_head's reduce-scatter input released, its output (the gradient shard) kept
    assert untied == (6, {"layer": apart, "embed": apart}, [False, True], True), untied
    root = {"embed": True, "lm_head": True, "norm": True}
    assert tied == (3, {"layer": root, "embed": root}, [], True), tied


def _rank_apply_order():
    import arctic
    from ulysses import SequenceParallelDims

    mesh = SequenceParallelDims(world_size=1, ulysses_degree=1).build_mesh("cpu")
    zero = _tiny_llama()
    next(zero.parameters()).ds_id = 0  # what a DeepSpeed ZeRO partition leaves on parameters
    errors = {"zero": _error(lambda: arctic.apply_fsdp(zero, mesh=mesh))}
    model = arctic.apply_fsdp(_tiny_llama(), mesh=mesh)
    sharded = sum(type(m).__name__.startswith("FSDP") for m in model.modules())
    errors["tiled_mlp"] = _error(lambda: arctic.apply_tiled_mlp(model, tiles=2))
    errors["again"] = _error(lambda: arctic.apply_fsdp(model, mesh=mesh))
    return sharded, errors


def test_apply_fsdp_refuses_zero_and_stages_after_it():
    sharded, errors = dist_pool.run(_rank_apply_order, world_size=1, timeout=120)[0]
    assert sharded == 6  # two decoder layers, the embedding, the lm_head, the norm, the root
    assert "FSDP2 and ZeRO cannot be mixed" in errors["zero"], errors
    assert "cannot apply tiling" in errors["tiled_mlp"], errors
    assert "sharding is already applied" in errors["tiled_mlp"], errors
    assert "already sharded with fully_shard" in errors["again"], errors


def _offload_flags(model) -> list[tuple[str, bool, bool]]:
    """Per FSDP unit holding parameters: its policy's type name, whether every parameter is
    marked for offload (``FSDPParam.offload_to_cpu``, what FSDP2 branches on) and whether any
    is pinned. Private FSDP2 state: torch exposes no public accessor for the policy of a
    unit."""
    from torch.distributed.fsdp import FSDPModule

    from ulysses.torch_internals import fsdp_param_groups

    flags = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for group in fsdp_param_groups(m):
                flags.append((type(group.offload_policy).__name__,
                              all(p.offload_to_cpu for p in group.fsdp_params),
                              any(p.pin_memory for p in group.fsdp_params)))
    return flags


def _rank_offload_parity(steps: int):
    """Train the same tiny Llama ``steps`` AdamW steps without and with CPU offload, on this
    rank's own batches; returns per run: losses, full final parameters, offload flags and the
    device types of the local parameter, gradient and optimizer-state shards."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    import arctic

    mesh = get_mesh(2, 1)  # dp=2: FSDP2 over both ranks
    runs = {}
    for name, policy in (("plain", None), ("offload", CPUOffloadPolicy(pin_memory=False))):
        torch.manual_seed(0)
        model = arctic.apply_fsdp(_tiny_llama(), mesh=mesh, offload_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batches = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
        losses = []
        for _ in range(steps):
            ids = torch.randint(0, 64, (2, 16), generator=batches)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            devices = {p.to_local().device.type for p in model.parameters()}
            devices |= {p.grad.to_local().device.type for p in model.parameters()}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        devices |= {s["exp_avg"].to_local().device.type for s in optimizer.state.values()}
        params = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        runs[name] = losses, params, _offload_flags(model), devices
    return runs


def test_cpu_offload_matches_no_offload_on_2_ranks():
    for rank, runs in enumerate(dist_pool.run(_rank_offload_parity, 3, world_size=2,
                                              timeout=120)):
        (losses, params, flags, devices), ref = runs["offload"], runs["plain"]
        # Five units with parameters (two decoder layers, the embedding, the lm_head, the
        # norm; the root holds none), every parameter marked for offload and, without an
        # accelerator, none pinned; apply_fsdp ignoring the policy fails here.
        assert flags == [("CPUOffloadPolicy", True, False)] * 5, flags
        assert ref[2] == [("OffloadPolicy", False, False)] * 5, ref[2]
        assert devices == {"cpu"}, devices
        # CPU ranks: the offload's copies are no-ops and the same kernels run in the same
        # order, so fp32 losses and parameters agree exactly.
        assert losses == ref[0], (rank, losses, ref[0])
        for n, p in params.items():
            torch.testing.assert_close(p, ref[1][n], rtol=0, atol=0, msg=lambda m: f"{n}: {m}")


def test_check_offload_policy():
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    from arctic.train.fsdp import check_offload_policy

    for ok in (None, OffloadPolicy(), CPUOffloadPolicy(pin_memory=False)):
        check_offload_policy(ok)
    for bad, shown in (("cpu", "str 'cpu'"), (CPUOffloadPolicy, "type <class"),
                       (MixedPrecisionPolicy(), "MixedPrecisionPolicy")):
        with pytest.raises(ValueError, match=f"offload_policy must be a .*OffloadPolicy.*{shown}"):
            check_offload_policy(bad)
    if torch.accelerator.is_available():
        check_offload_policy(CPUOffloadPolicy(pin_memory=True))
    else:
        pinned = r"pin_memory=True.*CPUOffloadPolicy\(pin_memory=False"
        with pytest.raises(ValueError, match=pinned):
            check_offload_policy(CPUOffloadPolicy(pin_memory=True))


def _rank_bad_offload_policy():
    from torch.distributed.fsdp import FSDPModule

    import arctic
    from arctic.order import applied_stages

    model, mesh = _tiny_llama(), get_mesh(1, 1)
    with count_collectives() as counts:
        error = _error(lambda: arctic.apply_fsdp(model, mesh=mesh, offload_policy="cpu"))
    untouched = not any(isinstance(m, FSDPModule) for m in model.modules()) and \
        not applied_stages(model)
    return error, dict(counts), untouched


def test_apply_fsdp_refuses_a_non_policy_before_any_collective():
    error, counts, untouched = dist_pool.run(_rank_bad_offload_policy, world_size=1)[0]
    assert "offload_policy must be a torch.distributed.fsdp.OffloadPolicy" in error, error
    assert counts == {} and untouched, (counts, untouched)


def test_accelerate_launch_with_the_shipped_fsdp2_yaml(tmp_path):
    """``accelerate launch --config_file configs/accelerate_fsdp2_cpu_2proc.yaml
    examples/train_fsdp.py``: the script as it is, on the YAML's two processes (the script
    applies FSDP2 itself; accelerate launches it through torchrun), gives the single-device
    losses and gradients at dp=1 x sp=2."""
    accelerate = str(Path(sys.executable).parent / "accelerate")
    log, grads = tmp_path / "log.jsonl", tmp_path / "grads.pt"
    proc = subprocess.run(
        [accelerate, "launch", "--config_file",
         str(REPO / "configs" / "accelerate_fsdp2_cpu_2proc.yaml"), "examples/train_fsdp.py",
         "--seq-len", str(SEQ_LEN), "--lr", str(LR), "--sequence-parallel-size", "2",
         "--max-steps", str(STEPS), "--dump-grads", str(grads), "--log-file", str(log)],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = {r["step"]: r for r in map(json.loads, log.read_text().splitlines())}
    assert all(len(r["peak_mib"]) == 2 for r in records.values()), records  # two ranks ran
    _check_parity(records, torch.load(grads), dp=1)
