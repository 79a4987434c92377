"""`glimmer info --plan --hosts N` (info.distributed_plan): per-rank weights / KV cache / fit and the bytes and time
communicated, checked against hand computation on a small config (no weights: configs only)."""

from __future__ import annotations

import json

import pytest

from glimmer_mlx.info import LINKS, distributed_plan, memory_plan, parse_memory_gb

# D 64, 4 layers, 4 query / 2 KV heads of 16, MLP 128, vocab 512, window 8: every tensor's size is easy to write down
SMALL = {"model_type": "muse_glimmer", "vision_config": {},
         "text_config": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8}}
D, I, L, H, KV, HD, V = 64, 128, 4, 4, 2, 16, 512
B = 2  # bf16
Q_ROWS, KV_ROWS = H * HD, KV * HD  # 64, 32
LAYER = {"q": Q_ROWS * D, "k": KV_ROWS * D, "v": KV_ROWS * D, "gate": Q_ROWS * D, "o": D * Q_ROWS,
         "mlp": 3 * I * D, "norms": 4 * D}
EMB = V * D  # embedding and (untied) lm_head each
TOTAL = B * (L * sum(LAYER.values()) + 2 * EMB + D)


def plan(**kw):
    kw.setdefault("bits", None)
    kw.setdefault("drafter", None)
    return distributed_plan(SMALL, **kw)


def test_total_weights_are_the_single_host_plan():
    r = plan(hosts=2)
    assert r["total_weights_bytes"] == TOTAL == memory_plan(SMALL, None, bits=None, text_only=True)["weights_bytes"]


def test_tp_ranks_hold_their_slices_and_sum_to_the_total_plus_the_replicated_parts():
    r = plan(hosts=2, strategy="tp")
    replicated = B * (L * LAYER["norms"] + D)  # sandwich norms + final norm, whole on every rank
    split = B * (L * (sum(LAYER.values()) - LAYER["norms"]) + 2 * EMB) // 2
    for k in r["ranks"]:
        assert k["target_replicated_bytes"] == replicated
        assert k["target_split_bytes"] == split
        assert k["kv_heads"] == 1 and k["layers"] == [0, L - 1]
    assert sum(k["target_split_bytes"] for k in r["ranks"]) + replicated == TOTAL
    assert r["kv_replication"] == 1


def test_tp_with_kv_heads_replicated_counts_each_rank_one_head():
    r = plan(hosts=4, strategy="tp")  # 4 ranks > 2 KV heads: each KV head on 2 ranks
    assert r["kv_replication"] == 2
    kv_per_rank = B * L * (LAYER["k"] + LAYER["v"]) // KV  # one head's rows of k_proj and v_proj
    other = B * (L * (sum(LAYER.values()) - LAYER["norms"] - LAYER["k"] - LAYER["v"]) + 2 * EMB) // 4
    for k in r["ranks"]:
        assert k["kv_heads"] == 1
        assert k["target_split_bytes"] == other + kv_per_rank
    # summed over ranks: the total, plus the replicated norms 3 more times, plus each KV head's second copy
    replicated = B * (L * LAYER["norms"] + D)
    assert sum(k["target_split_bytes"] + k["target_replicated_bytes"] for k in r["ranks"]) == \
        TOTAL + 3 * replicated + B * L * (LAYER["k"] + LAYER["v"])


def test_pp_stages_hold_their_layers_and_half_the_vocabulary():
    r = plan(hosts=2, strategy="pp")
    layer = B * sum(LAYER.values())
    for k, layers in zip(r["ranks"], ([0, 1], [2, 3])):
        assert k["layers"] == layers
        assert k["target_split_bytes"] == 2 * layer + B * 2 * EMB // 2
        assert k["target_replicated_bytes"] == B * D  # the final norm
        assert k["kv_heads"] == KV


def test_kv_cache_per_rank_by_hand():
    # layer types counted backward: layers 3 (and -1) global, 0-2 sliding (window 8 + rewind rows kept)
    from glimmer_mlx.cache import DEFAULT_MAX_REWIND

    c = 4096
    rows = [min(c, 8 - 1 + DEFAULT_MAX_REWIND)] * 3 + [c]
    tp = plan(hosts=2, strategy="tp", contexts=(c,))
    pp = plan(hosts=2, strategy="pp", contexts=(c,))
    assert tp["ranks"][0]["rows"][0]["kv_cache_bytes"] == sum(rows) * 2 * 1 * HD * B  # K and V, 1 head
    assert pp["ranks"][0]["rows"][0]["kv_cache_bytes"] == sum(rows[:2]) * 2 * KV * HD * B
    assert pp["ranks"][1]["rows"][0]["kv_cache_bytes"] == sum(rows[2:]) * 2 * KV * HD * B


def test_tp_communication_by_hand():
    r = plan(hosts=2, strategy="tp", link="tb5")
    t = r["communication"]["per_token"]
    allsum = D * B  # one all_sum payload per position: the hidden state in bf16
    assert t["allreduce_payload_bytes"] == (2 * L + 1) * allsum  # 2 per layer + the embedding lookup
    assert t["gather_bytes"] == V * B
    assert t["collectives"] == 2 * L + 2
    # ring, N = 2: an all-reduce sends its payload once per rank in 2 messages, the gather half the logits in 1
    assert t["sent_bytes_per_rank"] == (2 * L + 1) * allsum + V * B / 2
    assert t["messages"] == (2 * L + 1) * 2 + 1
    want = t["messages"] * 100e-6 + t["sent_bytes_per_rank"] / (80e9 / 8)
    assert t["seconds"] == pytest.approx(want) and t["tok_s_bound"] == pytest.approx(1 / want)
    for f, n in zip(r["communication"]["per_round"], (8, 16)):  # no drafter: the same collectives on n positions
        assert f["positions"] == n and f["collectives"] == t["collectives"]
        assert f["allreduce_payload_bytes"] == n * t["allreduce_payload_bytes"]
        assert f["gather_bytes"] == n * t["gather_bytes"]


def test_pp_communication_by_hand_and_the_drafters_taps():
    r = plan(hosts=2, strategy="pp")
    t = r["communication"]["per_token"]
    assert r["communication"]["stage_boundaries"] == [1, 3]
    assert t["collectives"] == 1 + 2 + 1  # embedding, 2 hand-overs, the logits gather
    assert t["allreduce_payload_bytes"] == 3 * D * B
    drafter = {"model_type": "muse_glimmer_assistant", "hidden_size": D, "intermediate_size": 64,
               "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
               "target_layer_ids": [0, 3]}
    d = plan(hosts=2, strategy="pp", drafter=drafter)
    assert d["communication"]["stage_boundaries_with_drafter"] == [0, 1, 3]
    f = d["communication"]["per_round"][0]  # L = 8: +1 tap hand-over, + the drafter's embedding and logits
    assert f["collectives"] == (1 + 3) + 1 + 2
    assert f["allreduce_payload_bytes"] == 8 * (1 + 3 + 1) * D * B
    assert f["gather_bytes"] == 2 * 8 * V * B
    assert d["communication"]["per_token"]["collectives"] == 4  # plain decoding: no taps
    # the drafter is whole on every rank
    assert all(k["replicated_parts_bytes"]["DFlash drafter"] == d["drafter"]["bytes"] > 0 for k in d["ranks"])


def test_one_host_communicates_nothing():
    r = plan(hosts=1)
    assert r["communication"]["per_token"]["seconds"] == 0 and r["communication"]["per_token"]["tok_s_bound"] is None
    assert r["ranks"][0]["target_split_bytes"] + r["ranks"][0]["target_replicated_bytes"] == TOTAL


def test_fit_uses_each_ranks_memory():
    r = plan(hosts=2, memory_gb=[0.4, 64], contexts=(4096,))  # 0.4 GB cannot hold the 1.5 GB overhead
    assert r["ranks"][0]["rows"][0]["fits"] == {0.4: "no"} and r["ranks"][1]["rows"][0]["fits"] == {64: "yes"}
    assert parse_memory_gb("48", 3) == [48.0] * 3 and parse_memory_gb("64,32", 2) == [64.0, 32.0]
    assert parse_memory_gb(None, 2) is None


@pytest.mark.parametrize("kw, msg", [
    (dict(hosts=0), "--hosts 0: needs at least 1 host"),
    (dict(hosts=3), "tensor parallelism over 3 ranks: num_attention_heads 4 is not divisible by 3"),
    (dict(hosts=8), "tensor parallelism over 8 ranks: num_attention_heads 4 is not divisible by 8"),
    (dict(hosts=2, link="usb2"), "--link 'usb2': unknown link (known: tb5, tb5-rdma, tb4, 10gbe, 1gbe)"),
    (dict(hosts=2, strategy="dp"), "--strategy 'dp': one of tp, pp"),
    (dict(hosts=5, strategy="pp"), "pipeline parallelism over 5 ranks: the model has only 4 layers"),
])
def test_errors(kw, msg):
    with pytest.raises(ValueError) as e:
        plan(**kw)
    assert msg in str(e.value)


def test_memory_gb_count_must_match_the_hosts():
    with pytest.raises(ValueError, match="give one size .every host. or 2 sizes .one per host., not 3"):
        parse_memory_gb("1,2,3", 2)
    with pytest.raises(ValueError, match="numbers"):
        parse_memory_gb("lots", 2)


def test_muse_glimmer_two_macs():
    """The preset: 52 layers, D 6656, V 202 048 — the figures the docs quote."""
    tp = distributed_plan("muse-glimmer-30b", hosts=2, strategy="tp", link="tb5")
    t = tp["communication"]["per_token"]
    assert t["collectives"] == 106 and t["allreduce_payload_bytes"] == 105 * 6656 * 2
    assert t["gather_bytes"] == 202048 * 2
    pp = distributed_plan("muse-glimmer-30b", hosts=2, strategy="pp", link="tb5")
    assert pp["communication"]["per_token"]["collectives"] == 4
    assert pp["communication"]["stage_boundaries_with_drafter"] == [1, 13, 25, 37, 49, 51]
    four = distributed_plan("muse-glimmer-30b", hosts=4, strategy="tp")  # 2 KV heads over 4 ranks: replicated
    assert four["kv_replication"] == 2 and all(k["kv_heads"] == 1 for k in four["ranks"])
    assert set(LINKS) == {"tb5", "tb5-rdma", "tb4", "10gbe", "1gbe"}


def _cli(args):
    from typer.testing import CliRunner

    from glimmer_mlx.cli import app

    return CliRunner().invoke(app, ["info", "muse-glimmer-30b", "--plan", *args], env={"COLUMNS": "200"})


def test_cli_table_and_json():
    r = _cli(["--hosts", "2", "--link", "tb5", "--memory-gb", "48"])
    assert r.exit_code == 0, r.output
    assert "--distributed tp" in r.output and "token" in r.output and "round L=16" in r.output
    j = _cli(["--hosts", "2", "--strategy", "pp", "--json"])
    assert j.exit_code == 0, j.output
    data = json.loads(j.output)
    assert data["strategy"] == "pp" and len(data["ranks"]) == 2
    single = _cli(["--json"])  # the single-host plan as JSON too
    assert single.exit_code == 0 and json.loads(single.output)["parts"]["text tower"]["params"] > 27e9
    assert _cli(["--hosts", "2"]).exit_code == 0


@pytest.mark.parametrize("args, msg", [
    (["--hosts", "0"], "--hosts 0: needs at least 1 host"),
    (["--hosts", "3"], "num_attention_heads 32 is not divisible by 3"),
    (["--hosts", "2", "--link", "fiber"], "--link 'fiber': unknown link"),
    (["--hosts", "2", "--memory-gb", "1,2,3"], "give one size (every host) or 2 sizes"),
])
def test_cli_errors_are_one_line_and_exit_non_zero(args, msg):
    r = _cli(args)
    assert r.exit_code == 1
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and msg in lines[0], r.output
