"""Configs as the model's own transformers config class writes and reads them: every key
under each of its names (gpt-oss's ``num_experts_per_tok`` / ``experts_per_token``,
``num_local_experts`` / ``num_experts``, ``swiglu_limit``, ``swiglu_alpha``; Kimi K3's
attribute_map), and the gpt-oss checkpoint writer's output as other tools take it (named
architectures, a tokenizer, written in memory bounded by a tensor, not the model)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from mxfp4x import nn
from mxfp4x.checkpoints.safetensors import SafeTensorsCheckpoint
from mxfp4x.testing.gpt_oss import write_gpt_oss_layer
from mxfp4x.testing.kimi_k3 import k3_config, write_k3_checkpoint

E, H, F, K = 6, 64, 64, 3
TINY_MODEL = dict(num_hidden_layers=2, hidden_size=H, intermediate_size=F,
                  num_local_experts=E, num_experts_per_tok=K, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, vocab_size=384)


@pytest.fixture(scope="module")
def layer_file(tmp_path_factory):
    """A gpt-oss layer 0 (its file and a config.json this module rewrites per test)."""
    folder = tmp_path_factory.mktemp("gpt_oss_layer")
    write_gpt_oss_layer(str(folder), layer=0, seed=9, num_local_experts=E, hidden_size=H,
                        intermediate_size=F, experts_per_token=K)
    return str(folder / "model.safetensors")


def _folder_with(tmp_path, layer_file, config):
    folder = tmp_path / "ck"
    folder.mkdir(exist_ok=True)
    if not (folder / "model.safetensors").exists():
        os.symlink(layer_file, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _x(n=5):
    return torch.from_numpy(np.random.default_rng(4).standard_normal((n, H))).float()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("transformers")
    from mxfp4x.testing.gpt_oss import write_gpt_oss_model

    folder = str(tmp_path_factory.mktemp("gpt_oss_model"))
    write_gpt_oss_model(folder, seed=2, **TINY_MODEL)
    return folder


def test_a_transformers_config_loads(model):
    """config.json from transformers' GptOssConfig has num_experts_per_tok only: the
    block refused it ("'experts_per_token' is missing; pass top_k=")."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    assert "experts_per_token" not in cfg and cfg["num_experts_per_tok"] == K
    for layer in (0, 1):
        moe = nn.GptOssMoE.from_checkpoint(model, layer)
        assert moe.router.top_k == K and moe.experts.n_experts == E
        assert (moe.experts.limit, moe.experts.alpha) == (cfg["swiglu_limit"],
                                                          cfg["swiglu_alpha"])
        assert moe(_x()).shape == (5, H)


@pytest.mark.parametrize("keys", [
    {"num_experts_per_tok": K}, {"experts_per_token": K},
    {"num_experts_per_tok": K, "experts_per_token": K},  # the release states both
    {"experts_per_token": K, "num_experts": E}, {"num_experts_per_tok": K,
                                                 "num_local_experts": E}],
    ids=["transformers", "openai", "released", "alias-experts", "names"])
def test_every_name_of_a_key_is_read(tmp_path, layer_file, keys):
    base = nn.GptOssMoE.from_checkpoint(layer_file, 0, top_k=K)
    moe = nn.GptOssMoE.from_checkpoint(_folder_with(tmp_path, layer_file, keys), 0)
    assert moe.router.top_k == K
    assert torch.equal(moe(_x()), base(_x()))


def test_the_activation_is_read_under_transformers_names(tmp_path, layer_file):
    base = nn.GptOssMoE.from_checkpoint(layer_file, 0, top_k=K)
    folder = _folder_with(tmp_path, layer_file, {"num_experts_per_tok": K,
                                                 "swiglu_limit": 3.5, "swiglu_alpha": 1.25})
    for experts in (nn.GptOssMoE.from_checkpoint(folder, 0).experts,
                    nn.GptOssExperts.from_checkpoint(folder, 0),
                    nn.load_gpt_oss_experts(folder, progress=False)[0]):
        assert (experts.limit, experts.alpha) == (3.5, 1.25)
    moe = nn.GptOssMoE.from_checkpoint(folder, 0)
    assert not torch.equal(moe(_x()), base(_x()))
    # given: the argument wins over the config
    assert nn.GptOssExperts.from_checkpoint(folder, 0, limit=7.0, alpha=1.702).limit == 7.0


@pytest.mark.parametrize("keys,match", [
    ({}, "num_experts_per_tok.*experts_per_token.*top_k="),
    ({"num_experts_per_tok": K, "experts_per_token": K - 1},
     "'experts_per_token' is 2 but 'num_experts_per_tok' is 3"),
    ({"num_experts_per_tok": K, "num_experts": E + 1}, "num_local_experts is 7"),
    ({"num_experts_per_tok": K, "num_local_experts": E, "num_experts": E + 1},
     "'num_experts' is 7 but 'num_local_experts' is 6"),
    ({"num_experts_per_tok": 0}, "top_k"),
    ({"num_experts_per_tok": K, "swiglu_alpha": "x"}, "swiglu_alpha")])
def test_missing_and_conflicting_keys_are_named(tmp_path, layer_file, keys, match):
    with pytest.raises(ValueError, match=match):
        nn.GptOssMoE.from_checkpoint(_folder_with(tmp_path, layer_file, keys), 0)


def test_kimi_k3_reads_its_config_class_aliases(tmp_path):
    """KimiLinearConfig's attribute_map: num_experts_per_tok, n_group, norm_topk_prob,
    n_shared_experts, num_local_experts name the same settings."""
    sizes = dict(hidden_size=128, routed_expert_hidden_size=64, num_experts=8,
                 num_experts_per_token=2, moe_intermediate_size=64, num_shared_experts=1,
                 num_hidden_layers=2, num_expert_group=2, topk_group=1, moe_renormalize=False)
    folder = tmp_path / "k3"
    write_k3_checkpoint(str(folder), k3_config(**sizes), [1], seed=4, shards=1,
                        dense_dtype=torch.float32)
    base = nn.KimiK3MoE.from_checkpoint(str(folder), 1, progress=False)
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((4, 128))).float()
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    text = cfg["text_config"]
    for canonical, alias in (("num_experts_per_token", "num_experts_per_tok"),
                             ("num_expert_group", "n_group"),
                             ("moe_renormalize", "norm_topk_prob"),
                             ("num_shared_experts", "n_shared_experts"),
                             ("num_experts", "num_local_experts")):
        text[alias] = text.pop(canonical)
    path.write_text(json.dumps(cfg))
    aliased = nn.KimiK3MoE.from_checkpoint(str(folder), 1, progress=False)
    r, s = aliased.router, base.router
    assert (r.top_k, r.n_group, r.renormalize) == (s.top_k, s.n_group, s.renormalize) == (
        2, 2, False)
    assert torch.equal(aliased(x), base(x))
    text["num_experts_per_token"] = 3  # and its alias says 2
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'num_experts_per_tok' is 2 but "
                                         "'num_experts_per_token' is 3"):
        nn.KimiK3MoE.from_checkpoint(str(folder), 1, progress=False)


# ---- the writer --------------------------------------------------------------------------

def test_the_written_model_names_its_architecture_and_has_a_tokenizer(model):
    import transformers

    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["GptOssForCausalLM"]
    assert cfg["model_type"] == "gpt_oss"
    tok = transformers.AutoTokenizer.from_pretrained(model)
    text = "The MXFP4 experts run on mxfp4x, même hors ASCII: ½ ✓."
    ids = tok(text)["input_ids"]
    assert len(ids) > 10 and max(ids) < cfg["vocab_size"]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(tok) == cfg["vocab_size"]  # the embedding's rows, every one a token
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token = tok.convert_ids_to_tokens(cfg[key])
        assert token in tok.all_special_tokens, key
    assert tok.eos_token_id == cfg["eos_token_id"]
    cfg_t = transformers.AutoConfig.from_pretrained(model)
    assert cfg_t.architectures == ["GptOssForCausalLM"]


PROBE = r"""
import json, sys
sys.path.insert(0, {tests!r})
from memory_probe import peak_rss
import torch, transformers  # noqa: F401 (imported before the baseline)
from mxfp4x.testing.gpt_oss import write_gpt_oss_model
write_gpt_oss_model({warm!r}, **{tiny!r})  # every lazy import and cache made
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak starts again from here
before = peak_rss()
write_gpt_oss_model({folder!r}, **{config!r})
print(json.dumps({{"before": before, "peak": peak_rss()}}))
"""


def test_the_writer_holds_a_piece_of_a_tensor_not_the_model(tmp_path):
    """A small model whose embedding and head (vocab 65536 x 1024, 128 MiB each in bf16)
    dwarf the rest: writing it grows the peak RSS by less than that one tensor (it grew by
    about five times it: float32 draws, a scaled copy, the bf16 tensor, and its bytes
    copied again for the file).  The bound leaves room for what is not a tensor: the
    65,536-token tokenizer it writes too takes tens of MiB, more in a fresh environment."""
    pytest.importorskip("transformers")
    config = dict(num_hidden_layers=1, hidden_size=1024, intermediate_size=256,
                  num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=64, vocab_size=65536)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = PROBE.format(tests=tests, warm=str(tmp_path / "warm"), tiny=TINY_MODEL,
                          folder=str(tmp_path / "ck"), config=config)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    largest = 0
    ckpt = SafeTensorsCheckpoint(str(tmp_path / "ck"))
    for name in ckpt.keys():
        shape = ckpt.shape(name)
        largest = max(largest, int(np.prod(shape)) * ckpt.get(name).element_size())
    assert largest == 65536 * 1024 * 2
    grown = found["peak"] - found["before"]
    print(f"\nwriter: peak RSS grew by {grown / 2**20:.0f} MiB; largest tensor "
          f"{largest / 2**20:.0f} MiB")
    assert grown < largest


def test_ep_bench_reads_a_kimi_k3_config_as_the_loader_does(tmp_path, capsys):
    """``ep-bench --checkpoint``'s sizes through the same aliases: a config stating
    num_experts_per_tok was refused ("num_experts_per_token is None")."""
    from mxfp4x import cli

    folder = tmp_path / "k3"
    write_k3_checkpoint(str(folder), k3_config(
        hidden_size=128, routed_expert_hidden_size=64, num_experts=8,
        num_experts_per_token=2, moe_intermediate_size=64, num_shared_experts=1,
        num_hidden_layers=2), [1], seed=4, shards=1, dense_dtype=torch.float32)
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["text_config"]["num_experts_per_tok"] = cfg["text_config"].pop("num_experts_per_token")
    path.write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["ep-bench", "--checkpoint", str(folder), "--experts", "9"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert "argument --experts: expected 2 to 8 experts" in err, err
