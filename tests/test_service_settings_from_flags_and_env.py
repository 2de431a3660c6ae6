"""Each process as a service: settings from flags or VOXPIPE_* variables, tcp:// addresses that
bind on the binding side and name hosts on the connecting side."""

from __future__ import annotations

import pytest

from common.cli import ROLE_COMMANDS, build_parser
from common.config import CodecSettings, GpuWorkerSettings, ServeConfig
from common.ipc import ROLE_SOCKETS, Addresses, bind_address
from common.options import parse_role, resolve


def test_flags_win_over_environment_and_environment_over_defaults():
    env = {"VOXPIPE_MODEL": "orpheus", "VOXPIPE_MAX_BATCH_SIZE": "8", "VOXPIPE_GPU_IN": "tcp://gpu:6000"}
    s = parse_role("gpu_worker", ["--model", "orpheus-tiny", "--tap", "tcp://*:5570"], env)
    assert s.cfg.model == "orpheus-tiny"  # flag
    assert s.cfg.gpu.max_batch_size == 8  # environment
    assert s.cfg.gpu.page_size == ServeConfig().gpu.page_size  # default
    assert s.cfg.addresses.gpu_in == "tcp://gpu:6000"
    assert s.cfg.addresses.codec_in == Addresses.tcp().codec_in  # default tcp book
    assert s.tap == "tcp://*:5570" and s.name == "gpu_worker"


def test_config_json_from_the_launcher_ignores_the_environment():
    book = {f: f"ipc:///run/vp/{f}" for f in Addresses.__struct_fields__}
    cfg = ServeConfig(model="orpheus-tiny", addresses=Addresses(**book))
    env = {"VOXPIPE_MODEL": "orpheus", "VOXPIPE_GATEWAY_IN": "tcp://elsewhere:1"}
    s = parse_role("codec_worker", ["--config-json", cfg.to_json(), "--name", "codec_worker"], env)
    assert s.cfg.model == "orpheus-tiny"
    assert s.cfg.addresses == cfg.addresses


def test_boolean_and_integer_variables_parse_and_bad_ones_name_the_variable():
    s = parse_role("gateway", [], {"VOXPIPE_CONSTRAINED": "false", "VOXPIPE_PORT": "9000"})
    assert s.cfg.gateway.constrained is False and s.cfg.gateway.port == 9000
    with pytest.raises(SystemExit):
        parse_role("gateway", [], {"VOXPIPE_PORT": "eighty"})
    with pytest.raises(ValueError, match="VOXPIPE_PORT"):
        resolve("gateway", build_parser().parse_args(["gateway"]), {"VOXPIPE_PORT": "eighty"})


def test_a_connecting_process_given_a_bind_address_is_told_which_host_to_name():
    ns = build_parser().parse_args(["gpu-worker", "--gpu-in", "tcp://*:5559"])
    with pytest.raises(ValueError, match=r"--gpu-in / VOXPIPE_GPU_IN .* tcp://gateway:5559"):
        resolve("gpu_worker", ns, {})


def test_binding_sides_bind_every_interface_for_host_names_and_keep_ip_literals():
    assert bind_address("tcp://gateway:5557") == "tcp://*:5557"
    assert bind_address("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"
    assert bind_address("tcp://localhost:5557") == "tcp://127.0.0.1:5557"
    assert bind_address("tcp://0.0.0.0:5557") == "tcp://0.0.0.0:5557"
    assert bind_address("ipc:///run/vp/requests") == "ipc:///run/vp/requests"


def test_every_role_command_parses_and_takes_exactly_the_addresses_it_uses():
    parser = build_parser()
    for command, role in ROLE_COMMANDS.items():
        args = parser.parse_args([command])
        binds, connects = ROLE_SOCKETS[role]
        for field in Addresses.__struct_fields__:
            assert hasattr(args, field) == (field in binds + connects), (role, field)
    assert parser.parse_args(["serve", "--tokenizer-workers", "3"]).tokenizer_workers == 3
    assert parser.parse_args(["tap", "--rid", "x", "--stage", "admitted"]).rid == ["x"]


def test_replicas_of_the_tokenizer_get_distinct_default_names():
    a = parse_role("tokenizer_worker", [], {})
    assert a.name.startswith("tokenizer_worker.") and a.name != "tokenizer_worker"
    assert parse_role("gateway", [], {}).name == "gateway"


def test_realtime_headroom_reaches_the_engine_clock_and_out_of_range_is_refused():
    from common.cli import _validate
    from gpu_worker.engine import Engine
    from programs import get_spec, load_program_class

    s = parse_role("gpu_worker", ["--model", "orpheus-tiny", "--realtime-headroom", "0.9"], {})
    assert s.cfg.gpu.realtime_headroom == 0.9
    p = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    p.load_lm()
    eng = Engine(
        p, GpuWorkerSettings(max_batch_size=2, max_context=64, realtime_headroom=s.cfg.gpu.realtime_headroom)
    )
    assert eng.clock.headroom == 0.9
    with pytest.raises(ValueError, match="--realtime-headroom"):
        _validate(ServeConfig(model="orpheus-tiny", gpu=GpuWorkerSettings(realtime_headroom=1.5)))
    with pytest.raises(ValueError, match="--capacity-headroom"):
        _validate(ServeConfig(model="orpheus-tiny", gpu=GpuWorkerSettings(capacity_headroom=0.2)))
    with pytest.raises(ValueError, match="--capacity-headroom"):  # a gpu_worker run alone checks it too
        Engine(p, GpuWorkerSettings(max_batch_size=2, max_context=64, capacity_headroom=1.2))
    CAPACITY_HEADROOM = GpuWorkerSettings().capacity_headroom

    # the default, the same for `voxpipe serve`, a gpu_worker run alone and the clock
    assert eng.clock.capacity_headroom == ServeConfig().gpu.capacity_headroom == CAPACITY_HEADROOM
    with pytest.raises(ValueError, match="--sit-out"):
        _validate(ServeConfig(model="orpheus-tiny", gpu=GpuWorkerSettings(sit_out_lead_s=-1.0)))
    with pytest.raises(ValueError, match="--sit-out"):
        _validate(
            ServeConfig(model="orpheus-tiny", gpu=GpuWorkerSettings(sit_out_lead_s=0.1))
        )  # less than a chunk's trip
    with pytest.raises(ValueError, match="--max-lead"):
        _validate(ServeConfig(model="orpheus-tiny", gpu=GpuWorkerSettings(max_lead_s=0.5)))
    _validate(ServeConfig(model="orpheus-tiny", gpu=GpuWorkerSettings(max_lead_s=2.0)))
    from gpu_worker.worker import engine_limits

    spec = get_spec("orpheus-tiny")
    for argv, env, spare in ((["--sit-out", "0"], {}, 0.0), ([], {"VOXPIPE_SIT_OUT": "0.75"}, 0.75)):
        s = parse_role("gpu_worker", ["--model", "orpheus-tiny", *argv], env)
        limits = engine_limits(s.cfg, spec, "cpu")
        assert limits.sit_out_lead_s == spare
        sit = Engine(p, limits).sit_out
        assert (sit is None) if spare == 0 else sit.spare_s == spare
    for argv, env in ((["--capacity-headroom", "0.85"], {}), ([], {"VOXPIPE_CAPACITY_HEADROOM": "0.85"})):
        s = parse_role("gpu_worker", ["--model", "orpheus-tiny", *argv], env)
        assert Engine(p, engine_limits(s.cfg, spec, "cpu")).clock.capacity_headroom == 0.85
    assert eng.sit_out is not None and eng.sit_out.spare_s == 0.5  # the default
    with pytest.raises(ValueError, match="--sit-out"):  # a gpu_worker run alone checks it too
        Engine(p, GpuWorkerSettings(max_batch_size=2, max_context=64, sit_out_lead_s=-1.0))
    with pytest.raises(ValueError, match="--codec-gpu-share"):  # a cap under MPS, and MPS is off
        _validate(ServeConfig(model="orpheus-tiny", codec=CodecSettings(gpu_share=50)))


def test_each_flag_sets_its_process_group_and_the_json_round_trips():
    from common.options import OPTIONS

    d = ServeConfig()
    for opt in OPTIONS:
        if opt.kind == "config":
            opt.default(d)  # every option names a field of ServeConfig or of one of its groups
    argv = ["--model", "orpheus-tiny", "--disable-cuda-graph", "--sit-out", "0.75", "--codec-max-batch", "8"]
    s = parse_role("codec_worker", argv[:3], {})
    assert s.cfg.codec.cuda_graphs is False and s.cfg.gpu.cuda_graphs is False
    s = parse_role("gpu_worker", argv[:5], {"VOXPIPE_PAGE_SIZE": "32"})
    assert s.cfg.gpu.sit_out_lead_s == 0.75 and s.cfg.gpu.page_size == 32
    cfg = resolve("serve", build_parser().parse_args(["serve", *argv]), {}).cfg
    assert cfg.codec.max_batch == 8 and not cfg.gpu.cuda_graphs
    assert ServeConfig.from_json(cfg.to_json()) == cfg
    again = parse_role("gpu_worker", ["--config-json", cfg.to_json()], {"VOXPIPE_SIT_OUT": "2"})
    assert again.cfg.gpu == cfg.gpu and again.cfg.codec == cfg.codec
    resolved = cfg.gpu.resolved("cpu", max_tokens=1200)
    assert resolved.max_batch_size == 16 and resolved.max_context == 1200 and cfg.gpu.max_batch_size == 0
