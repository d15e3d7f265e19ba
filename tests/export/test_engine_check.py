"""The served model folder, the exported-vs-engine comparison and ``kvguard check-engine``.

Everything but the last test runs without vLLM: a tiny real Llama folder (saved by transformers, sharded
too), a profile shaped for it, and a stand-in engine python that prints the report a probe would. The last
test loads a real export of SmolLM2 in the real vLLM of ``make engines`` and is skipped when that venv is
absent.
"""

import json
import stat
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvguard import cli
from kvguard.entropy import EntropyBaseline
from kvguard.export import engine_check, served_model
from kvguard.export.export import ExportError, ExportSpec, export
from kvguard.plan import LayerPlan, Plan
from kvguard.profile import Profile
from tests.helpers import profile_meta, tiny_llama
from tests.export.test_export import profile  # noqa: F401  (the real SmolLM2 profile fixture)

ENGINE_PYTHON = Path(__file__).resolve().parents[2] / ".venv-engines" / "bin" / "python"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder, sharded model folder, export directory) for a 2-layer, 2-KV-head, head_dim-16 Llama."""
    root = tmp_path_factory.mktemp("engine")
    model = tiny_llama()
    model.save_pretrained(root / "model")
    model.save_pretrained(root / "sharded", max_shard_size="100KB")
    gen = torch.Generator().manual_seed(0)
    tensors = {f"calibrated.{kv}.absmax": torch.rand(2, 2, 16, generator=gen) * 5 + 0.5 for kv in ("key", "value")}
    # The loader checks a profile whole: it needs the entropy baseline too.
    tensors.update(EntropyBaseline(*(torch.rand(2, 4, 3, generator=gen) for _ in range(3)),
                                   torch.rand(2, 4, generator=gen)).tensors())
    plan = Plan((LayerPlan(("int8", "int8")), LayerPlan(("int4", "fp16"))))
    profile = Profile(profile_meta(plan, name="tiny", head_dim=16), tensors)
    profile.save(root / "profile")
    profile = Profile.load(root / "profile")
    export(profile, ExportSpec("vllm"), root / "export")
    return root / "model", root / "sharded", root / "export"


def test_served_folder_holds_weights_scales_and_the_merged_config(tiny, tmp_path):
    model_dir, sharded_dir, export_dir = tiny
    served = served_model.build(model_dir, export_dir, tmp_path / "served")
    config = json.loads((served.path / "config.json").read_text())
    assert config["quantization_config"]["kv_cache_scheme"]["type"] == "float" and not served.sharded
    assert config["num_hidden_layers"] == 2  # the model's own config, merged, not replaced
    assert (served.path / "model.safetensors").stat().st_size == (model_dir / "model.safetensors").stat().st_size
    with safe_open(str(served.path / "kv_cache_scales.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(f"model.layers.{i}.self_attn.{kv}_scale" for i in range(2) for kv in "kv")
    # A sharded model: the scale names join the index, pointing to the scale file; the shards come along.
    served = served_model.build(sharded_dir, export_dir, tmp_path / "served-sharded")
    index = json.loads((served.path / "model.safetensors.index.json").read_text())["weight_map"]
    assert served.sharded and index["model.layers.1.self_attn.v_scale"] == "kv_cache_scales.safetensors"
    assert len(set(index.values())) > 2 and all((served.path / f).is_file() for f in set(index.values()))
    original = json.loads((sharded_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert all(index[k] == v for k, v in original.items())


def test_served_folder_refuses_what_vllm_would_misread(tiny, tmp_path):
    model_dir, _, export_dir = tiny
    block = {"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8}}
    kept = served_model.merged_config({"quantization_config": {"quant_method": "compressed-tensors",
                                                                "config_groups": {"g": 1}}}, block)
    assert kept["quantization_config"] == {"quant_method": "compressed-tensors", "config_groups": {"g": 1},
                                           "kv_cache_scheme": {"num_bits": 8}}
    with pytest.raises(ExportError, match="quantized with 'awq'"):
        served_model.merged_config({"quantization_config": {"quant_method": "awq"}}, block)
    with pytest.raises(ExportError, match="already hold"):
        served_model.merged_index({"weight_map": {"model.layers.0.self_attn.k_scale": "w.safetensors"}},
                                  ["model.layers.0.self_attn.k_scale"])
    wrong = tmp_path / "wrong"
    tiny_llama(num_hidden_layers=3).save_pretrained(wrong)
    with pytest.raises(ExportError, match=r"num_layers 3 \(export: 2\)"):
        served_model.build(wrong, export_dir, tmp_path / "x")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="no served model folder kvguard wrote"):
        served_model.build(model_dir, export_dir, foreign)
    with pytest.raises(ExportError, match="holds no kvguard export"):
        served_model.build(model_dir, tmp_path, tmp_path / "y")
    assert (foreign / "notes.txt").read_text() == "mine" and not (tmp_path / "x").exists()


def _report_json(export_dir, change=None, drop=None, **extra) -> dict:
    """What a probe prints for the export's scales, with layer ``drop`` left out and ``change = (layer, value)``."""
    scales = engine_check.exported_scales(export_dir, "tensor")
    layers = {}
    for i in range(scales.num_layers):
        if i == drop:
            continue
        k, v = scales.key[i].reshape(-1).tolist(), scales.value[i].reshape(-1).tolist()
        if i == (change or (None,))[0]:
            k = [change[1]]
        layers[str(i)] = {"k_scale": k, "v_scale": v}
    return {"engine": "vllm", "version": "test", "layers": layers, "cache_dtype": "fp8", **extra}


def _report(export_dir, **kw) -> engine_check.EngineReport:
    return engine_check.EngineReport.from_json(_report_json(export_dir, **kw))


def test_compare_reports_each_layer_and_refuses_missing_or_default_scales(tiny):
    _, _, export_dir = tiny
    scales = engine_check.exported_scales(export_dir, "tensor")
    good = engine_check.compare(scales, _report(export_dir))
    assert good.ok and [c.match for c in good.layers] == [True, True]
    assert f"| 0 | {scales.key[0].item():.6g} | {scales.key[0].item():.6g} |" in good.table()
    for report, problem in ((_report(export_dir, drop=1), "layer 1: missing in the engine"),
                            (_report(export_dir, change=(0, 1.0)), "layer 0: scale 1.0 in the engine (the scale file was not read)"),
                            (_report(export_dir, change=(1, 0.5)), "layer 1: differs from the export")):
        result = engine_check.compare(scales, report)
        assert not result.ok and result.problems == [problem]
        assert "NO: " in result.table()
    extra = _report(export_dir)
    extra.layers[7] = ([0.1], [0.1])
    with pytest.raises(ValueError, match=r"attention layers \[7\] the export does not know"):
        engine_check.compare(scales, extra)


def _fake_engine(tmp_path: Path, report: dict) -> Path:
    """A stand-in for a venv's python: ``-c 'import vllm'`` succeeds, ``import sglang`` fails, and running the
    probe prints ``report`` the way the probe does (after some engine log lines)."""
    tmp_path.mkdir()
    (tmp_path / "report.json").write_text(json.dumps(report))
    script = tmp_path / "python"
    script.write_text(f"""#!{sys.executable}
import sys
if sys.argv[1] == "-c":
    sys.exit(0 if "vllm" in sys.argv[2] else 1)
print("INFO engine log line")
print("KVGUARD_PROBE " + open({str(tmp_path / 'report.json')!r}).read())
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_check_engine_cli_prints_the_table_and_fails_on_a_default_scale(tiny, tmp_path, capsys):
    model_dir, _, export_dir = tiny
    refused = "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
    good = _fake_engine(tmp_path / "good", _report_json(export_dir, error=refused))
    args = ["check-engine", str(export_dir), "--model-dir", str(model_dir), "--served-out", str(tmp_path / "s")]
    assert cli.main(args + ["--engine-python", str(good)]) == 0
    out = capsys.readouterr().out
    assert "| 1 |" in out and "| yes |" in out and "all 2 layers hold exactly the exported" in out
    assert "refused to run: NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512" in out
    assert "SGLang is not importable" in out
    bad_python = _fake_engine(tmp_path / "bad", _report_json(export_dir, change=(1, 1.0)))
    assert cli.main(args + ["--engine-python", str(bad_python)]) == 2
    captured = capsys.readouterr()
    assert "NO: scale 1.0 in the engine" in captured.out
    assert "the engine does not hold the exported scales: layer 1: scale 1.0" in captured.err
    assert cli.main(args + ["--engine-python", str(tmp_path / "none")]) == 2
    assert "does not exist; create the engine venv with `make engines`" in capsys.readouterr().err
    assert cli.main(args) == 0  # no engine: the folder only, and it says so
    assert "engine not checked: pass --engine-python" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.skipif(not ENGINE_PYTHON.is_file(), reason="vLLM's venv is absent: run `make engines` to check in vLLM")
def test_real_vllm_loads_the_exported_smollm2_scales(profile, tmp_path):
    """The SmolLM2 profile of test_export (real K/V statistics, FP16 layers 0, 7, 29 skipped)."""
    from kvguard import models

    export(profile, ExportSpec("vllm"), tmp_path / "export")
    served = served_model.build(models.converted_dir("smollm2-135m"), tmp_path / "export", tmp_path / "served")
    report = engine_check.run_vllm(served.path, ENGINE_PYTHON)
    result = engine_check.compare(engine_check.exported_scales(tmp_path / "export", "tensor"), report)
    assert report.engine == "vllm" and report.cache_dtype == "fp8" and len(report.layers) == 30
    assert result.ok, result.problems


def test_per_token_head_exports_carry_the_arguments_and_the_chosen_skip_list(tiny, tmp_path):
    profile = Profile.load(tiny[2].parent / "profile")
    manifest = export(profile, ExportSpec("vllm", kv_cache_dtype="int4_per_token_head"), tmp_path / "plain")
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["README.md", "kvguard_export.json"]
    assert manifest["engine_args"] == ["--kv-cache-dtype", "int4_per_token_head", "--kv-cache-dtype-skip-layers", "1"]
    assert manifest["eval_method"] == "vllm-int4_per_token_head" and manifest["scales"] is None
    choice = {"dtype": "int4_per_token_head", "budget": 0.7, "chosen": [0],
              "candidates": [{"skip": [], "memory": 0.375, "kl": 0.2, "ppl_increase_pct": 9.0, "top1_agree": 0.8},
                             {"skip": [0], "memory": 0.69, "kl": 0.1, "ppl_increase_pct": 4.0, "top1_agree": 0.9}]}
    manifest = export(profile, ExportSpec("vllm", kv_cache_dtype="int4_per_token_head"), tmp_path / "c", skip_choice=choice)
    assert manifest["engine_args"][-2:] == ["--kv-cache-dtype-skip-layers", "0"]
    readme = (tmp_path / "c" / "README.md").read_text()
    assert "vllm serve MODEL_DIR --kv-cache-dtype int4_per_token_head --kv-cache-dtype-skip-layers 0" in readme
    assert "| 0 | 0.690 | 0.10000 | +4.00 |" in readme
    with pytest.raises(ExportError, match="chosen for int4_per_token_head, the export is fp8"):
        export(profile, ExportSpec("vllm"), tmp_path / "d", skip_choice=choice)
    with pytest.raises(ExportError, match="fits the memory budget 0.1"):
        export(profile, ExportSpec("vllm", kv_cache_dtype="int4_per_token_head"), tmp_path / "d",
               skip_choice=dict(choice, chosen=None, budget=0.1))
    with pytest.raises(ExportError, match=r"--kv-cache-dtype has to be one of \[fp8, int8_per_token_head"):
        ExportSpec("vllm", kv_cache_dtype="int2")
    with pytest.raises(ExportError, match="SGLang exports are fp8"):
        ExportSpec("sglang", kv_cache_dtype="int8_per_token_head")
