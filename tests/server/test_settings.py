"""Settings: file < environment < flags, strict keys, clear errors."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from proxy.server.settings import DEFAULT_CONFIG, NOT_SETTINGS, Settings, SettingsError, load_settings

ROOT = Path(__file__).resolve().parents[2]


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cachetally.toml"
    path.write_text(text)
    return path


def test_file_then_env_then_flags_later_wins(tmp_path: Path) -> None:
    config = toml(
        tmp_path,
        '[cachetally]\nport = 7000\nhost = "0.0.0.0"\nmissing = "omit"\nmax_event_bytes = 4096\n',
    )
    env = {"CACHETALLY_PORT": "8001", "CACHETALLY_MISSING": "zero", "CACHETALLY_LEDGER_TTL_S": "30.5"}
    settings = load_settings(config, env=env, overrides={"port": 9000})

    assert settings.port == 9000  # flag beats env beats file
    assert settings.missing == "zero"  # env beats file
    assert settings.host == "0.0.0.0"  # file beats default
    assert settings.max_event_bytes == 4096
    assert settings.ledger_ttl_s == 30.5
    assert settings.max_request_bytes == Settings().max_request_bytes  # untouched default


def test_flags_left_as_none_do_not_override(tmp_path: Path) -> None:
    config = toml(tmp_path, "[cachetally]\nport = 7000\n")
    settings = load_settings(config, env={}, overrides={"port": None, "host": None})
    assert settings.port == 7000
    assert settings.host == "127.0.0.1"


def test_unknown_key_in_toml_is_an_error(tmp_path: Path) -> None:
    config = toml(tmp_path, "[cachetally]\nprot = 8000\n")
    with pytest.raises(SettingsError, match="unknown setting 'prot'"):
        load_settings(config, env={})


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("port = 7000\n", "1 key(s) or table(s) sit outside it, such as port"),  # the header forgotten
        ("[server]\nport = 7000\n", "1 key(s) or table(s) sit outside it (not named here"),  # another table
        ("cachetally = 5\n", "cachetally must be a table"),
        ("[cachetally]\nport = 7000\n[cachetally.extra]\n", "unknown setting 'extra'"),
    ],
)
def test_a_key_outside_the_cachetally_table_is_an_error_not_ignored(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(says)):
        load_settings(toml(tmp_path, text), env={})


@pytest.mark.parametrize("text", ['"sk-live-aaaa" = "acme"\n"sk-live-bbbb" = "globex"\n',
                                  '"sk-live-aaaa" = "acme"\n"sk-live-aaaa" = "globex"\n',
                                  "[sk-live-aaaa]\n[sk-live-aaaa]\n"])
def test_the_api_keys_file_given_as_config_is_refused_without_printing_a_key(tmp_path: Path, text: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(toml(tmp_path, text), env={})
    assert "sk-live" not in str(info.value)


@pytest.mark.parametrize(
    ("host", "url", "loops"),
    [
        ("127.0.0.1", "http://127.0.0.1:8000", True),  # the default port: vLLM's, and cachetally's
        ("127.0.0.1", "http://localhost:8000", True),
        ("0.0.0.0", "http://127.0.0.1:8000/base", True),
        ("10.0.0.5", "http://10.0.0.5:8000", True),
        ("10.0.0.5", "http://127.0.0.1:8000", False),  # listening elsewhere: loopback:8000 is another server
        ("127.0.0.1", "http://127.0.0.1:8001", False),
    ],
)
def test_an_upstream_at_this_servers_own_address_is_refused(tmp_path: Path, host: str, url: str, loops: bool) -> None:
    """It started, forwarded each request to itself until its pool ran dry, and answered 503."""
    flags = {"upstream": url, "host": host, "port": 8000}
    if loops:
        with pytest.raises(SettingsError, match="is this server: serve on another --port"):
            load_settings(toml(tmp_path, ""), env={}, overrides=flags)
    else:
        assert load_settings(toml(tmp_path, ""), env={}, overrides=flags).upstream == url


@pytest.mark.parametrize("engine", [{"engine": "sim"}, {"upstream": "http://127.0.0.1:8001"}])
def test_vllm_flags_given_to_another_engine_are_refused_not_ignored(tmp_path: Path, engine: dict) -> None:
    with pytest.raises(SettingsError, match="are vLLM's; the (sim|upstream) engine takes none"):
        load_settings(toml(tmp_path, ""), env={}, overrides={**engine, "engine_args": ["--max-model-len", "4096"]})
    assert load_settings(toml(tmp_path, ""), env={}, overrides={"engine_args": ["--max-model-len", "4096"]}).engine_args


def test_unknown_flag_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="unknown setting"):
        load_settings(toml(tmp_path, ""), env={}, overrides={"colour": "blue"})


def test_bad_int_in_env_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="CACHETALLY_PORT|port"):
        load_settings(toml(tmp_path, ""), env={"CACHETALLY_PORT": "eighty"})


def test_bad_value_in_toml_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="port"):
        load_settings(toml(tmp_path, '[cachetally]\nport = "eighty"\n'), env={})


def test_invalid_toml_and_missing_file_are_errors(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read config"):
        load_settings(toml(tmp_path, "[cachetally\n"), env={})
    absent = tmp_path / "absent.toml"
    with pytest.raises(SettingsError) as refused:
        load_settings(absent, env={})
    assert str(refused.value) == f"cannot read config {absent}: No such file or directory"  # the reason, once


def test_env_vars_without_the_prefix_or_unknown_are_ignored_and_the_unknown_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A misspelt variable (``CACHETALLY_API_KEYS``, the docs' old name for the keys file)
    would leave the server without its key check: it is named in a warning, never its value."""
    env = {"PORT": "1", "CACHETALLY_NOT_A_SETTING": "x", "CACHETALLY_ENGINE_ARGS": "--max-model-len 4096",
           "CACHETALLY_API_KEYS": "/secret/keys.toml", "CACHETALLY_MODEL_DIR": "/models"}
    with caplog.at_level("WARNING", logger="cachetally.settings"):
        settings = load_settings(toml(tmp_path, ""), env=env)
    assert settings.port == 8000 and settings.api_keys_file is None
    assert settings.engine_args == ["--max-model-len", "4096"]
    [warning] = [r.getMessage() for r in caplog.records]
    assert "CACHETALLY_API_KEYS, CACHETALLY_NOT_A_SETTING" in warning
    assert "/secret" not in warning and "MODEL_DIR" not in warning and "PORT" not in warning


def test_every_variable_the_docs_name_is_read(tmp_path: Path) -> None:
    """A user sets what README.md, docs/ACCOUNTING.md and docs/DEPLOY.md say."""
    text = "".join((ROOT / name).read_text() for name in ("README.md", "docs/ACCOUNTING.md", "docs/DEPLOY.md"))
    named = set(re.findall(r"CACHETALLY_[A-Z0-9_]+", text)) - {"CACHETALLY_SOAK"}  # the test suite's own knob
    settings = {"CACHETALLY_" + f.name.upper() for f in dataclasses.fields(Settings)}
    assert named - settings - NOT_SETTINGS == set()


def test_an_engine_flag_wins_over_an_upstream_in_the_environment(tmp_path: Path) -> None:
    """Flags win: ``cachetally serve --engine sim`` with ``CACHETALLY_UPSTREAM`` exported serves the sim."""
    env = {"CACHETALLY_UPSTREAM": "http://127.0.0.1:8001"}
    assert load_settings(toml(tmp_path, ""), env=env, overrides={"engine": "sim"}).engine == "sim"
    assert load_settings(toml(tmp_path, ""), env=env, overrides={"engine": None}).engine == "upstream"


def test_upstream_implies_the_upstream_engine(tmp_path: Path) -> None:
    settings = load_settings(toml(tmp_path, ""), env={}, overrides={"upstream": "http://127.0.0.1:8001"})
    assert (settings.engine, settings.upstream) == ("upstream", "http://127.0.0.1:8001")

    # Even when a lower layer chose another engine.
    settings = load_settings(
        toml(tmp_path, '[cachetally]\nengine = "sim"\n'), env={}, overrides={"upstream": "http://h:1"}
    )
    assert settings.engine == "upstream"


def test_upstream_engine_without_a_url_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="upstream URL"):
        load_settings(toml(tmp_path, '[cachetally]\nengine = "upstream"\n'), env={})
    # An empty URL in the file means "none".
    with pytest.raises(SettingsError, match="upstream URL"):
        load_settings(toml(tmp_path, '[cachetally]\nengine = "upstream"\nupstream = ""\n'), env={})


@pytest.mark.parametrize("url", ["127.0.0.1:8001", "ftp://h:1", "http://", "unix:///tmp/s"])
def test_an_upstream_that_is_not_an_http_url_is_an_error(tmp_path: Path, url: str) -> None:
    with pytest.raises(SettingsError, match="upstream must be http"):
        load_settings(toml(tmp_path, ""), env={}, overrides={"upstream": url})


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("engine", '"tgi"', "engine must be"),
        ("missing", '"estimate"', "missing must be"),
        ("port", "0", "port"),
        ("otlp_endpoint", '"collector:4318"', "otlp_endpoint must be an http"),
        ("usage_flush_interval_s", "0", "usage_flush_interval_s must be > 0"),
        ("usage_max_file_bytes", "100", "usage_max_file_bytes must be >= 4096"),
        ("usage_queue_size", "0", "usage_queue_size must be >= 1"),
        ("otlp_timeout_s", "-1", "otlp_timeout_s must be > 0"),
        ("tenants", '["ok", "not ok"]', "tenant name"),
        ("workers", "0", "workers must be >= 1"),
        ("workers", "2", "--api-server-count"),  # with the default engine, vLLM
    ],
)
def test_invalid_values_are_errors(tmp_path: Path, key: str, value: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(toml(tmp_path, f"[cachetally]\n{key} = {value}\n"), env={})


def test_settings_constructor_does_no_io() -> None:
    # Keyword fields with defaults; validate() is separate and pure.
    settings = Settings(engine="sim", port=9)
    assert settings.validate() is settings


def _uncommented_default_config() -> str:
    if not DEFAULT_CONFIG.exists():
        pytest.skip(f"{DEFAULT_CONFIG} is not in this checkout")
    # The file shows every key commented out with its built-in default.
    return re.sub(r"(?m)^# ([a-z_]+ = )", r"\1", DEFAULT_CONFIG.read_text())


def test_default_config_file_as_shipped_changes_nothing() -> None:
    _uncommented_default_config()  # skips when absent
    assert load_settings(DEFAULT_CONFIG, env={}) == Settings().validate()


def test_default_config_file_names_only_real_settings_with_their_defaults(tmp_path: Path) -> None:
    uncommented = _uncommented_default_config()
    keys = set(tomllib.loads(uncommented)["cachetally"])
    assert keys, "no settings found in the default config"
    assert keys <= {f.name for f in dataclasses.fields(Settings)}
    assert load_settings(toml(tmp_path, uncommented), env={}) == Settings().validate()


def test_engine_args_from_the_environment_are_read_as_a_shell_reads_them(tmp_path: Path) -> None:
    """vLLM's JSON flags hold spaces: ``--kv-transfer-config '{"kv_role": "kv_both"}'``."""
    config = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
    env = {"CACHETALLY_ENGINE_ARGS": f"--kv-transfer-config '{config}' --served-model-name \"my model\""}
    settings = load_settings(toml(tmp_path, ""), env=env)
    assert settings.engine_args == ["--kv-transfer-config", config, "--served-model-name", "my model"]
    with pytest.raises(SettingsError, match="engine_args"):
        load_settings(toml(tmp_path, ""), env={"CACHETALLY_ENGINE_ARGS": "--chat-template 'unclosed"})


@pytest.mark.parametrize(
    ("source", "key", "value", "message"),
    [
        ("env", "log_level", "verbose", "log_level must be one of"),
        ("toml", "log_level", '"loud"', "log_level must be one of"),
        ("toml", "workers", "1.5", "bad value for workers: expected an integer"),
        ("toml", "port", "true", "bad value for port: expected an integer"),
        ("toml", "host", "5", "bad value for host: expected a string"),
        ("toml", "usage_dir", "5", "bad value for usage_dir: expected a string"),
        ("toml", "tenants", "[1, 2]", "bad value for tenants: expected a list of strings"),
        ("toml", "pd_legs", "1", "bad value for pd_legs: expected true or false"),
        ("toml", "max_request_bytes", "-1", "max_request_bytes must be >= 1"),
        ("env", "max_event_bytes", "0", "max_event_bytes must be >= 1"),
        ("env", "max_request_bytes_held", "1024", "max_request_bytes_held must be 0 or >= max_request_bytes"),
        ("env", "max_response_bytes_held", "1024", "max_response_bytes_held must be 0 or >= max_response_bytes"),
        ("toml", "max_response_bytes_held", "-1", "max_response_bytes_held must be 0 or >= max_response_bytes"),
        ("toml", "ledger_ttl_s", "-5", "ledger_ttl_s must be > 0"),
        ("env", "sim_token_delay_s", "-1", "sim_token_delay_s must be >= 0"),
        ("toml", "sim_prefill_delay_s", "-0.5", "sim_prefill_delay_s must be >= 0"),
    ],
)
def test_a_value_of_the_wrong_type_or_range_is_refused_with_its_name(
    tmp_path: Path, source: str, key: str, value: str, message: str
) -> None:
    """Each of these started the server anyway (max_request_bytes = -1: every request a 413
    "exceeds -1 bytes") or ended in a traceback from logging, uvicorn or pathlib."""
    if source == "env":
        config, env = toml(tmp_path, ""), {f"CACHETALLY_{key.upper()}": value}
    else:
        config, env = toml(tmp_path, f"[cachetally]\n{key} = {value}\n"), {}
    with pytest.raises(SettingsError, match=message):
        load_settings(config, env=env)


def test_log_level_and_numbers_of_the_right_type_are_taken(tmp_path: Path) -> None:
    config = toml(tmp_path, '[cachetally]\nlog_level = "DEBUG"\nledger_ttl_s = 30\nusage_flush_interval_s = 2\n')
    settings = load_settings(config, env={})
    assert settings.log_level == "debug"
    assert settings.ledger_ttl_s == 30.0 and isinstance(settings.ledger_ttl_s, float)
    assert settings.usage_flush_interval_s == 2.0
