"""merge_adapter's numpy parts: streaming safetensors I/O and the LoRA merge, on the tiny checkpoint.

Every expectation is computed independently (einsum on arrays loaded by the official
``safetensors`` library), never with the code under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from loraflow.dev import tinymodel
from loraflow.lora import merge_numerics as contract
from loraflow.lora.merge import (
    LoraConfig,
    LoraTarget,
    MergeError,
    load_adapter_config,
    lora_scale,
    merge_checkpoint,
    merge_lora,
    peft_module,
    plan_merge,
)
from loraflow.lora.safetensors_io import (
    INDEX_FILE,
    Checkpoint,
    SafetensorsError,
    ShardedWriter,
    TensorInfo,
    TensorSpec,
    plan_shards,
    safetensors_dtype,
)
from loraflow.steps import merge_adapter
from loraflow.steps._harness import StepContext

REPO = Path(__file__).resolve().parents[2]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BF16 = ml_dtypes.bfloat16


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    corpus = REPO / "pipelines/data/parity/train.jsonl"
    return tinymodel.create(tmp_path_factory.mktemp("base"), [corpus] if corpus.exists() else [])


@pytest.fixture(scope="module")
def base_bf16(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint in bf16, written with the official library."""
    out = tmp_path_factory.mktemp("base_bf16")
    for f in base.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = {k: v.astype(BF16) for k, v in load_file(str(base / "model.safetensors")).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def load_all(ckpt: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint dir, through the official library and the index if any."""
    index = ckpt / INDEX_FILE
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    out: dict[str, np.ndarray] = {}
    for f in files:
        out |= load_file(str(ckpt / f))
    return out


def make_adapter(
    root: Path,
    base: Path,
    *,
    r: int = 4,
    alpha: float = 8.0,
    targets: list[str] = TARGETS,
    dtype: type = np.float32,
    seed: int = 0,
    config: dict | None = None,
    zero_b: bool = False,
) -> dict[str, np.ndarray]:
    """A random PEFT adapter for ``base`` in ``root/peft``; returns its tensors."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, w in load_file(str(base / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in targets:
            continue
        out_dim, in_dim = w.shape
        tensors[f"base_model.model.{module}.lora_A.weight"] = (rng.standard_normal((r, in_dim)) * 0.1).astype(dtype)
        b = np.zeros((out_dim, r)) if zero_b else rng.standard_normal((out_dim, r)) * 0.05
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.astype(dtype)
    write_adapter(root, tensors, {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets,
                                  **(config or {})})  # fmt: skip
    return tensors


def write_adapter(root: Path, tensors: dict[str, np.ndarray], config: dict) -> Path:
    peft = root / "peft"
    peft.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(peft / "adapter_model.safetensors"))
    (peft / "adapter_config.json").write_text(json.dumps(config))
    return root


def expected_merge(base_tensors: dict[str, np.ndarray], adapter: dict[str, np.ndarray], scale: float) -> dict:
    """Independent reference: W + scale * einsum(B, A) in float32, cast once to W's dtype."""
    out = {}
    for key, a in adapter.items():
        if ".lora_A." not in key:
            continue
        b = adapter[key.replace(".lora_A.", ".lora_B.")]
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        w = base_tensors[name]
        delta = np.einsum("or,ri->oi", b.astype(np.float32), a.astype(np.float32)) * np.float32(scale)
        out[name] = (w.astype(np.float32) + delta).astype(w.dtype)
    return out


# ----------------------------------------------------------------------------------- the math


def test_merge_lora_matches_einsum_and_keeps_dtype() -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((37, 23)).astype(np.float32)
    a, b = rng.standard_normal((3, 23)).astype(np.float32), rng.standard_normal((37, 3)).astype(np.float32)
    ref = w + 0.5 * np.einsum("or,ri->oi", b, a)
    for block in (1, 50, 1 << 22):  # row blocks of every size give the same result
        got = merge_lora(w, a, b, 0.5, block_elems=block)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    w_copy = w.copy()
    merge_lora(w, a, b, 0.5)
    assert np.array_equal(w, w_copy), "the input weight must not be modified"
    # fan_in_fan_out: W stored [in, out]
    got = merge_lora(w.T.copy(), a, b, 0.5, fan_in_fan_out=True)
    np.testing.assert_allclose(got, ref.T, rtol=1e-6, atol=1e-6)
    with pytest.raises(MergeError, match="do not compose"):
        merge_lora(w, a[:, :-1], b, 0.5)


def test_merge_lora_float16_overflow_is_an_error() -> None:
    w = np.full((2, 2), 60000, np.float16)
    with pytest.raises(MergeError, match="overflow float16"):
        merge_lora(w, np.ones((1, 2), np.float32), np.ones((2, 1), np.float32) * 1e4, 1.0)


def test_scale_and_keys() -> None:
    assert lora_scale(16, 32) == 2.0
    assert lora_scale(16, 32, use_rslora=True) == 8.0
    assert peft_module("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight") == (
        "model.layers.0.self_attn.q_proj",
        "A",
    )
    assert peft_module("base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight") == (
        "model.layers.1.mlp.down_proj",
        "B",
    )
    with pytest.raises(MergeError, match="only plain LoRA"):
        peft_module("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector")


# ----------------------------------------------------------------------------- safetensors I/O


def test_reader_matches_official_library(base: Path, base_bf16: Path) -> None:
    for ckpt in (base, base_bf16):
        ref = load_file(str(ckpt / "model.safetensors"))
        reader = Checkpoint.open(ckpt)
        seen = 0
        for name, array in reader:
            assert array.dtype == ref[name].dtype and array.shape == ref[name].shape
            assert array.tobytes() == ref[name].tobytes()
            assert b"".join(reader.copy_raw(name, chunk_bytes=1000)) == ref[name].tobytes()
            seen += 1
        assert seen == len(ref)


def test_sharded_writer_is_readable_by_safetensors(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    tensors = {
        "big": rng.standard_normal((300, 100)).astype(np.float32),  # 120 kB: larger than a shard
        "b16": rng.standard_normal((7, 9)).astype(BF16),
        "f16": rng.standard_normal((5,)).astype(np.float16),
        "i64": np.arange(6, dtype=np.int64).reshape(2, 3),
        "scalar": np.array(3.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
        "flag": np.array([True, False]),
    }
    specs = [TensorSpec(k, safetensors_dtype(v.dtype), v.shape) for k, v in tensors.items()]
    with ShardedWriter(tmp_path, specs, max_shard_bytes=50_000, metadata={"note": "x"}) as w:
        for k, v in tensors.items():
            w.write(k, v)
    assert w.result is not None and len(w.result.files) == 2  # "big" alone, then the rest
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
    assert set(index["weight_map"]) == set(tensors)
    for name, f in index["weight_map"].items():
        with safe_open(str(tmp_path / f), framework="numpy") as st:
            got = st.get_tensor(name)
            assert st.metadata() == {"format": "pt", "note": "x"}
        assert got.dtype == tensors[name].dtype and got.tobytes() == tensors[name].tobytes()
    assert not list(tmp_path.glob("*.partial"))
    assert [p.name for p in Checkpoint.open(tmp_path).files] == sorted(set(index["weight_map"].values()))


def test_empty_plan_writes_a_valid_file(tmp_path: Path) -> None:
    with ShardedWriter(tmp_path, [], 1000) as w:
        pass
    assert w.result is not None and w.result.files == [tmp_path / "model.safetensors"]
    assert load_file(str(tmp_path / "model.safetensors")) == {}


def test_plan_shards_and_writer_errors(tmp_path: Path) -> None:
    specs = [TensorSpec(f"t{i}", "F32", (10,)) for i in range(5)]  # 40 bytes each
    assert [len(s) for s in plan_shards(specs, 80)] == [2, 2, 1]
    assert [len(s) for s in plan_shards(specs, 10)] == [1, 1, 1, 1, 1]
    with pytest.raises(SafetensorsError, match="out of order"):
        with ShardedWriter(tmp_path / "a", specs, 80) as w:
            w.write("t1", np.zeros(10, np.float32))
    with pytest.raises(SafetensorsError, match="plan says F32"):
        with ShardedWriter(tmp_path / "b", specs, 80) as w:
            w.write("t0", np.zeros(10, np.float64))
    with pytest.raises(SafetensorsError, match="never written"):
        with ShardedWriter(tmp_path / "c", specs, 80) as w:
            for i in range(3):
                w.write(f"t{i}", np.zeros(10, np.float32))
    for d in ("a", "b", "c"):  # nothing half-written is left behind
        assert not list((tmp_path / d).iterdir())


def test_reader_rejects_corrupt_files(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    save_file({"x": np.ones((4, 4), np.float32)}, str(good))
    (tmp_path / "trunc.safetensors").write_bytes(good.read_bytes()[:-8])
    with pytest.raises(SafetensorsError, match="truncated"):
        Checkpoint.open(tmp_path / "trunc.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(SafetensorsError, match="header length"):
        Checkpoint.open(tmp_path / "junk.safetensors")


# ------------------------------------------------------------------------------ the merge driver


def test_merge_checkpoint_f32(base: Path, tmp_path: Path) -> None:
    adapter = make_adapter(tmp_path / "adapter", base)
    lines: list[str] = []
    report = merge_checkpoint(base, tmp_path / "adapter", tmp_path / "out", shard_bytes=400_000, progress=lines.append)

    base_t = load_file(str(base / "model.safetensors"))
    merged = load_all(tmp_path / "out")
    expected = expected_merge(base_t, adapter, lora_scale(4, 8.0))
    assert set(merged) == set(base_t)
    assert report.tensors == len(base_t) and report.merged == report.changed == len(expected) == 14
    for name, w in base_t.items():
        assert merged[name].dtype == w.dtype and merged[name].shape == w.shape
        if name in expected:
            np.testing.assert_allclose(merged[name], expected[name], rtol=1e-6, atol=1e-7, err_msg=name)
            assert not np.array_equal(merged[name], w)
        else:
            assert merged[name].tobytes() == w.tobytes(), f"{name} must be bit-identical"
    updates = [np.abs(np.einsum("or,ri->oi", adapter[k.replace(".lora_A.", ".lora_B.")], a)).max() * 2.0
               for k, a in adapter.items() if ".lora_A." in k]  # fmt: skip
    assert report.max_delta == pytest.approx(float(max(updates)), rel=1e-5)
    assert report.bytes == sum(v.nbytes for v in base_t.values())
    # sharded, with an index; every non-weight file copied byte for byte
    assert len(report.files) > 1 and (tmp_path / "out" / INDEX_FILE).exists()
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / f).read_bytes() == (base / f).read_bytes()
    assert any("model.layers.1: 9 tensor(s), 7 merged" in line for line in lines)


def test_merge_checkpoint_bf16_round_trip(base_bf16: Path, tmp_path: Path) -> None:
    adapter = make_adapter(tmp_path / "adapter", base_bf16, r=8, alpha=16, dtype=BF16, config={"use_rslora": True})
    report = merge_checkpoint(base_bf16, tmp_path / "adapter", tmp_path / "out", shard_bytes=1 << 30)
    assert report.files == ["model.safetensors"] and not (tmp_path / "out" / INDEX_FILE).exists()
    with safe_open(str(tmp_path / "out/model.safetensors"), framework="numpy") as st:
        assert st.metadata() == {"format": "pt"}
    base_t = load_file(str(base_bf16 / "model.safetensors"))
    merged = load_file(str(tmp_path / "out/model.safetensors"))
    expected = expected_merge(base_t, adapter, lora_scale(8, 16, use_rslora=True))
    for name, w in base_t.items():
        assert merged[name].dtype == BF16
        if name not in expected:
            assert merged[name].tobytes() == w.tobytes()
            continue
        # the merge's numerics contract: within the reordering bound of the exact reference (exactly
        # it where the native kernel runs); einsum's own sum order is not a reference
        a = adapter[f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight"].astype(np.float32)
        b = adapter[f"base_model.model.{name.removesuffix('.weight')}.lora_B.weight"].astype(np.float32)
        lo, hi = contract.merge_bounds(w, a, b, lora_scale(8, 16, use_rslora=True))
        assert contract.within(merged[name], lo, hi).all(), name


def test_merge_step_run(base: Path, tmp_path: Path) -> None:
    make_adapter(tmp_path / "adapter", base)
    (tmp_path / "adapter" / "loraflow_adapter.json").write_text("{}")  # lora_sft's other files are ignored
    ctx = StepContext(
        "merge_adapter", "gs://b/p/r/merge_adapter", {"base": base, "adapter": tmp_path / "adapter"},
        {}, tmp_path / "out", tmp_path / "work", {"shard_size_mb": 0.5},
    )  # fmt: skip
    ctx.out.mkdir()
    summary = merge_adapter.run(ctx)
    assert summary["tensors"] == 21 and summary["merged"] == 14 and summary["changed"] == 14
    assert summary["bytes"] == Checkpoint.open(base).total_bytes and summary["max_delta"] > 0
    assert len(load_all(ctx.out)) == 21


def test_untrained_adapter_changes_nothing_and_says_so(base: Path, tmp_path: Path) -> None:
    make_adapter(tmp_path / "adapter", base, zero_b=True)
    lines: list[str] = []
    report = merge_checkpoint(base, tmp_path / "adapter", tmp_path / "out", progress=lines.append)
    assert report.merged == 14 and report.changed == 0 and report.max_delta == 0.0
    assert any("WARNING" in line and "lora_B" in line for line in lines)


def test_rank_and_alpha_patterns_set_each_modules_scale(base: Path, tmp_path: Path) -> None:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` override r / lora_alpha per module (adapters
    trained elsewhere use them): each module merges at its own alpha / r, not the global one."""
    config = {
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": TARGETS,
        "rank_pattern": {"v_proj": 2, "model.layers.1.mlp.down_proj": 8},
        "alpha_pattern": {"o_proj": 2, "layers.1.mlp.down_proj": 48, "k_proj": 12},
    }  # fmt: skip

    def rank_alpha(module: str) -> tuple[int, float]:  # written out by hand, not PEFT's matching
        kind = module.rsplit(".", 1)[-1]
        if module == "model.layers.1.mlp.down_proj":
            return 8, 48.0
        return {"v_proj": (2, 8.0), "o_proj": (4, 2.0), "k_proj": (4, 12.0)}.get(kind, (4, 8.0))

    rng = np.random.default_rng(3)
    tensors: dict[str, np.ndarray] = {}
    scales: dict[str, float] = {}  # base tensor -> alpha / r of its module
    for name, w in load_file(str(base / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in TARGETS:
            r, alpha = rank_alpha(module)
            scales[name] = alpha / r
            a, b = rng.standard_normal((r, w.shape[1])) * 0.1, rng.standard_normal((w.shape[0], r)) * 0.05
            tensors[f"base_model.model.{module}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"base_model.model.{module}.lora_B.weight"] = b.astype(np.float32)
    write_adapter(tmp_path / "adapter", tensors, config)
    assert sorted(set(scales.values())) == [0.5, 2.0, 3.0, 4.0, 6.0]  # the global alpha / r is 2.0

    cfg = load_adapter_config(tmp_path / "adapter/peft/adapter_config.json")
    plan = plan_merge(Checkpoint.open(tmp_path / "adapter/peft").tensors, Checkpoint.open(base).tensors, cfg)
    assert {n: (t.rank, t.scale) for n, t in plan.items()} == {
        n: (rank_alpha(n.removesuffix(".weight"))[0], s) for n, s in scales.items()
    }

    lines: list[str] = []
    report = merge_checkpoint(base, tmp_path / "adapter", tmp_path / "out", progress=lines.append)
    base_t, merged = load_file(str(base / "model.safetensors")), load_all(tmp_path / "out")
    assert report.merged == report.changed == len(scales) == 14
    # the log tells the per-module settings, not the global r / alpha that no module here merges with alone
    assert "r/scale per module (rank_pattern / alpha_pattern): 2/4 x2, 4/0.5 x2, 4/2 x7, 4/3 x2, 8/6 x1" in lines[0]
    for name, scale in scales.items():
        module = name.removesuffix(".weight")
        pair = {k: v for k, v in tensors.items() if k.startswith(f"base_model.model.{module}.lora_")}
        expected = expected_merge(base_t, pair, scale)[name]
        np.testing.assert_allclose(merged[name], expected, rtol=1e-6, atol=1e-7, err_msg=name)


def info(name: str, shape: tuple[int, ...], dtype: str = "F32") -> TensorInfo:
    return TensorInfo(name, dtype, shape, Path("x.safetensors"), 0, 0)


def lora_pair(module: str, r: int, n_in: int, n_out: int) -> dict[str, TensorInfo]:
    a, b = f"base_model.model.{module}.lora_A.weight", f"base_model.model.{module}.lora_B.weight"
    return {a: info(a, (r, n_in)), b: info(b, (n_out, r))}


def test_plan_reads_target_modules_and_fan_in_fan_out_as_peft_does(tmp_path: Path) -> None:
    base = {"m.q.weight": info("m.q.weight", (6, 4)), "m.c_attn.weight": info("m.c_attn.weight", (4, 6))}
    q = lora_pair("m.q", 2, 4, 6)
    for targets in (None, "all-linear", r"m\.q", ["q"]):
        plan = plan_merge(q, base, LoraConfig(r=2, lora_alpha=4, target_modules=targets))
        a, b = q
        assert plan == {"m.q.weight": LoraTarget("m.q.weight", a, b, 2, 2.0)}, targets
    for targets in (r"m\.k", ["k"], "q"):  # a string is a regex over the whole module name
        with pytest.raises(MergeError, match="not in target_modules"):
            plan_merge(q, base, LoraConfig(r=2, lora_alpha=4, target_modules=targets))
    # fan_in_fan_out (GPT-2's Conv1D): the base weight is stored [in, out]
    conv = lora_pair("m.c_attn", 2, 4, 6)
    assert plan_merge(conv, base, LoraConfig(r=2, lora_alpha=4, fan_in_fan_out=True))["m.c_attn.weight"].rank == 2
    with pytest.raises(MergeError, match=r"need A \[2, 6\], B \[4, 2\]"):
        plan_merge(conv, base, LoraConfig(r=2, lora_alpha=4))
    cfg = {"r": 2, "lora_alpha": 4, "fan_in_fan_out": True, "use_rslora": True}
    loaded = load_config_from(cfg, tmp_path)
    assert (loaded.fan_in_fan_out, loaded.use_rslora, loaded.r, loaded.lora_alpha) == (True, True, 2, 4.0)
    plain = load_config_from({"r": 2, "lora_alpha": 4}, tmp_path)
    assert (plain.fan_in_fan_out, plain.use_rslora) == (False, False)


def load_config_from(raw: dict, folder: Path) -> LoraConfig:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps(raw))
    return load_adapter_config(path)


def test_adapter_configs_that_cannot_be_merged_are_refused_with_every_reason(tmp_path: Path) -> None:
    with pytest.raises(MergeError) as err:
        load_config_from({"peft_type": "ia3", "bias": "all", "r": 0, "lora_alpha": -1}, tmp_path)
    text = str(err.value)
    for reason in ("peft_type is 'ia3': only LORA", "bias is 'all': LoRA biases are not supported",
                   "r is 0: set it to the LoRA rank", "lora_alpha is -1: set it to the alpha"):  # fmt: skip
        assert reason in text
    assert load_config_from({"peft_type": "lora", "bias": "none", "r": 1, "lora_alpha": 1}, tmp_path).r == 1
    for bad in ({"r": 1.5, "lora_alpha": 1}, {"r": 1, "lora_alpha": "8"}, {"r": 1, "lora_alpha": 0}):
        with pytest.raises(MergeError, match=r"(r|lora_alpha) is"):
            load_config_from(bad, tmp_path)


def test_plan_lists_every_problem_of_an_adapter() -> None:
    base = {
        "m.q.weight": info("m.q.weight", (6, 4)),
        "m.k.weight": info("m.k.weight", (6, 4), "I8"),
        "m.v.weight": info("m.v.weight", (6, 4)),
    }
    adapter = {
        **lora_pair("m.q", 2, 4, 6),
        **lora_pair("m.k", 2, 4, 6),  # int8 base: not mergeable
        **lora_pair("m.v", 3, 4, 6),  # rank 3 while r is 2
        **lora_pair("m.o", 2, 4, 6),  # no such base tensor
        "base_model.model.m.u.lora_A.weight": info("base_model.model.m.u.lora_A.weight", (2, 4)),  # no lora_B
    }
    with pytest.raises(MergeError) as err:
        plan_merge(adapter, base, LoraConfig(r=2, lora_alpha=4, target_modules=["q", "k", "v", "o", "u"]))
    text = str(err.value)
    assert "cannot merge this adapter (4 problem(s))" in text
    assert "m.k.weight is I8: only F16/BF16/F32/F64" in text and "at rank 2" in text
    assert "'m.o.weight', which the base checkpoint does not hold (closest: 'm." in text
    assert "'base_model.model.m.u.lora_A.weight' has no lora_B partner" in text
    with pytest.raises(MergeError, match=r"\(1 problem\(s\)\):\n  - the adapter holds no lora_A/lora_B tensors"):
        plan_merge({}, base, LoraConfig(r=2, lora_alpha=4))


def test_plan_lists_the_problems_that_follow_each_kind_of_problem() -> None:
    """Each refusal moves on to the next module: whatever comes first, every problem is listed."""
    base = {"m.o.weight": info("m.o.weight", (6, 4)), "m.q.weight": info("m.q.weight", (6, 4))}
    u_a = "base_model.model.m.u.lora_A.weight"
    adapter = {
        "junk.weight": info("junk.weight", (2, 4)),  # no PEFT LoRA key
        u_a: info(u_a, (2, 4)),  # no lora_B
        **lora_pair("m.o", 2, 4, 6),  # not in target_modules
        **lora_pair("m.x", 2, 4, 6),  # no such base tensor
        **lora_pair("m.q", 2, 4, 6),  # fine
    }
    with pytest.raises(MergeError) as err:
        plan_merge(adapter, base, LoraConfig(r=2, lora_alpha=4, target_modules=["q", "x", "u"]))
    text = str(err.value)
    assert "cannot merge this adapter (4 problem(s))" in text
    assert "'junk.weight'" in text and f"{u_a!r} has no lora_B partner" in text
    assert "module m.o is not in target_modules" in text and "'m.x.weight', which the base checkpoint" in text
    twice = {**lora_pair("m.q", 2, 4, 6), "base_model.model.m.q.lora_A.default.weight": info("x", (2, 4))}
    with pytest.raises(MergeError, match=r"both give lora_A of m\.q: keep one adapter"):
        plan_merge(twice, base, LoraConfig(r=2, lora_alpha=4))


# ------------------------------------------------------------------------------------- failures


def _fails(base: Path, tmp_path: Path, match: str) -> MergeError:
    with pytest.raises(MergeError, match=match) as err:
        merge_checkpoint(base, tmp_path / "adapter", tmp_path / "out")
    out = tmp_path / "out"
    assert not out.exists() or not list(out.iterdir()), "a failed merge must write nothing"
    return err.value


def test_key_matching_no_base_tensor(base: Path, tmp_path: Path) -> None:
    tensors = make_adapter(tmp_path / "adapter", base)
    renamed = {k.replace("base_model.model.model.", "base_model.model."): v for k, v in tensors.items()}
    write_adapter(tmp_path / "adapter", renamed, {"r": 4, "lora_alpha": 8, "target_modules": TARGETS})
    err = _fails(base, tmp_path, "does not hold")
    assert "base_model.model.layers.0.self_attn.q_proj.lora_A.weight" in str(err)
    assert "closest: 'model.layers.0.self_attn.q_proj.weight'" in str(err)
    assert "14 problem(s)" in str(err)  # every problem at once


def test_shape_mismatch(base: Path, tmp_path: Path) -> None:
    tensors = make_adapter(tmp_path / "adapter", base)
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    tensors[key] = tensors[key][:-1]
    write_adapter(tmp_path / "adapter", tensors, {"r": 4, "lora_alpha": 8, "target_modules": TARGETS})
    err = _fails(base, tmp_path, "do not fit base model.layers.1.mlp.up_proj.weight")
    assert "1 problem(s)" in str(err)
    # a config whose r disagrees with the tensors
    make_adapter(tmp_path / "adapter", base, config={"r": 8})
    _fails(base, tmp_path, "r / rank_pattern is wrong")


def test_nan_or_inf_in_adapter(base: Path, tmp_path: Path) -> None:
    tensors = make_adapter(tmp_path / "adapter", base)
    tensors["base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"][0, 3] = np.nan
    tensors["base_model.model.model.layers.1.mlp.gate_proj.lora_B.weight"][2, 0] = np.inf
    write_adapter(tmp_path / "adapter", tensors, {"r": 4, "lora_alpha": 8, "target_modules": TARGETS})
    err = _fails(base, tmp_path, "non-finite values in 2 tensor")
    assert "layers.0.self_attn.v_proj.lora_A.weight (1 NaN, 0 Inf)" in str(err)
    assert "layers.1.mlp.gate_proj.lora_B.weight (0 NaN, 1 Inf)" in str(err)


def test_incomplete_or_unsupported_adapters(base: Path, tmp_path: Path) -> None:
    tensors = make_adapter(tmp_path / "adapter", base)
    del tensors["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = np.ones(128, np.float32)
    write_adapter(tmp_path / "adapter", tensors, {"r": 4, "lora_alpha": 8, "target_modules": TARGETS})
    err = _fails(base, tmp_path, "2 problem")
    assert "no lora_B partner" in str(err) and "lora_magnitude_vector" in str(err)
    make_adapter(tmp_path / "adapter", base, config={"use_dora": True})
    _fails(base, tmp_path, "DoRA")
    make_adapter(tmp_path / "adapter", base, config={"target_modules": ["q_proj"]})
    _fails(base, tmp_path, "not in target_modules")


def test_missing_adapter(base: Path, tmp_path: Path) -> None:
    (tmp_path / "adapter").mkdir()
    _fails(base, tmp_path, "holds no PEFT adapter")


def test_step_program_through_the_harness(base: Path, tmp_path: Path, gcs_bucket: str) -> None:
    """``python -m loraflow.steps.merge_adapter`` argv: inputs from GCS, merged checkpoint committed."""
    from loraflow.steps._harness import run_step
    from loraflow.storage import artifacts

    make_adapter(tmp_path / "adapter", base)
    base_uri, sft_uri, out_uri = (
        f"{gcs_bucket}/hf/tiny",
        f"{gcs_bucket}/run/lora_sft",
        f"{gcs_bucket}/run/merge_adapter",
    )
    artifacts.upload_tree(base, base_uri)
    files = artifacts.upload_tree(tmp_path / "adapter", sft_uri)
    artifacts.commit(sft_uri, files, stage="lora_sft", inputs={}, config={}, lock_version="t", cache_key="k",
                     summary={})  # fmt: skip
    argv = ["--output", out_uri, "--input", f"base={base_uri}", "--input", f"adapter={sft_uri}/{artifacts.MANIFEST}",
            "--config-json", json.dumps({"shard_size_mb": 0.5})]  # fmt: skip
    assert run_step("merge_adapter", merge_adapter.run, argv) == 0
    manifest = artifacts.read_manifest(out_uri)
    assert manifest.summary["merged"] == 14 and manifest.summary["tensors"] == 21
    assert INDEX_FILE in manifest.files and "config.json" in manifest.files and "tokenizer.json" in manifest.files
    artifacts.fetch(manifest, tmp_path / "fetched")
    assert len(load_all(tmp_path / "fetched")) == 21
