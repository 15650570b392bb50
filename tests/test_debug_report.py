"""JMC_DEBUG=1 makes each AllToAll say what was chosen and why (jax_moe_comm/debug.py);
unset, nothing is printed."""

from jax_moe_comm import AllToAll, MoEConfig


def _make(monkeypatch, capsys, value):
    if value is None:
        monkeypatch.delenv("JMC_DEBUG", raising=False)
    else:
        monkeypatch.setenv("JMC_DEBUG", value)
    cfg = MoEConfig(num_experts=16, experts_per_token=2, hidden=64, max_num_tokens=4,
                    world_size=8)
    with AllToAll(cfg, layout="packed", backend="auto"):
        pass
    return capsys.readouterr().err


def test_the_report_names_the_backend_and_why_the_layout_and_the_memory(monkeypatch, capsys):
    err = _make(monkeypatch, capsys, "1")
    lines = [line for line in err.splitlines() if line.startswith("[jax_moe_comm 0]")]
    text = "\n".join(lines)
    assert "backend reference (auto: jax's platform is 'cpu', not a GPU)" in text, err
    assert "layout packed, capacity max_recv_rows=" in text and "overflow 'fail'" in text
    assert "symmetric memory 0 bytes per rank" in text  # the reference backend holds none
    assert "dispatch float8_e4m3fn" in text or "dispatch bfloat16" in text


def test_nothing_is_printed_without_the_switch(monkeypatch, capsys):
    assert "[jax_moe_comm" not in _make(monkeypatch, capsys, None)
    assert "[jax_moe_comm" not in _make(monkeypatch, capsys, "0")
