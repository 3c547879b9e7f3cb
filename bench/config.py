"""Typed configuration of a run: which backends (engine + version + options), model, workload."""
from __future__ import annotations

import base64
import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import BaseModel, Field, SecretStr

from kvbench.backends import REGISTRY
from kvbench.backends.options import OptionError, validate
from kvbench.redact import SECRET_NAME, SECRET_OPTIONS, host_port, redact_text
from kvbench.suggest import hint as did_you_mean


class ConfigError(ValueError):
    pass


class BackendConfig(BaseModel):
    """One engine at one version. The version picks the isolated environment, so two versions of one
    engine can run in the same run (``vllm@0.31.0`` and ``vllm@0.32.0``)."""

    engine: str
    version: str
    options: dict = Field(default_factory=dict)
    url: str | None = None  # attach to a server already running there instead of starting one (no userinfo)
    #: ``user:password`` from the url's userinfo, sent as HTTP basic auth; never dumped, shown or written.
    credentials: SecretStr | None = Field(default=None, exclude=True, repr=False)

    @property
    def label(self) -> str:
        if self.url:
            return f"{self.engine}@{host_port(self.url)}"
        return f"{self.engine}-{self.version}"

    def auth_headers(self) -> dict[str, str]:
        """The headers that authenticate every request to an attached server: ``Authorization: Bearer`` with
        the value of the environment variable named by ``api_key_env``, else ``Basic`` from the url's
        ``user:password@`` (the key wins when both are given); {} without either."""
        name = self.options.get("api_key_env")
        if name:
            value = os.environ.get(str(name), "").strip()
            if not value:
                raise ConfigError(f"api_key_env={name}: the environment variable {name} is not set or empty "
                                  f"(it must hold the API key)")
            if any(c in value for c in "\r\n\0"):
                raise ConfigError(f"api_key_env={name}: the value of {name} holds a line break or NUL, which "
                                  f"cannot go into an HTTP header")
            return {"Authorization": f"Bearer {value}"}
        if self.credentials is not None:
            token = base64.b64encode(self.credentials.get_secret_value().encode()).decode()
            return {"Authorization": f"Basic {token}"}
        return {}

    @classmethod
    def parse(cls, text: str) -> "BackendConfig":
        """``ENGINE[@VERSION][:KEY=VALUE,...]``, e.g. ``vllm``, ``vllm@0.32.0``, ``llamacpp:threads=2``."""
        head, _, opts = text.partition(":")
        engine, _, version = head.partition("@")
        engine = engine.strip().lower()
        if engine not in REGISTRY:
            raise ConfigError(f"backend {engine!r} is not known; {did_you_mean(engine, REGISTRY)}allowed: {', '.join(sorted(REGISTRY))}")
        where = repr(redact_text(text))
        options = parse_options(opts, where)
        url, credentials = _split_url(options.pop("url", None), where)
        _check_credential_options(options, url, where)
        options = check_options(engine, options)
        cfg = cls(engine=engine, version=version or REGISTRY[engine].default_version, options=options, url=url,
                  credentials=credentials)
        cfg.auth_headers()  # an unset api_key_env variable is an error now, not in the middle of the run
        return cfg


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _split_url(value, where: str) -> tuple[str | None, SecretStr | None]:
    """The url option as (url without userinfo, ``user:password`` from its userinfo or None)."""
    if value is None:
        return None, None
    try:
        parts = urlsplit(str(value))
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        parts = None
    if parts is None or parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"the url in {where} must look like http://host:port or https://host[:port][/path]")
    if parts.query or parts.fragment:
        hint = (": give an API key through an environment variable instead (api_key_env=NAME)"
                if any(SECRET_NAME.search(p.partition("=")[0]) for p in parts.query.split("&")) else "")
        raise ConfigError(f"the url in {where} must not have a query or fragment (kvbench appends the API's "
                          f"paths to it){hint}")
    userinfo, at, hostport = parts.netloc.rpartition("@")
    credentials = None
    if at:
        user, _, password = userinfo.partition(":")
        credentials = SecretStr(f"{unquote(user)}:{unquote(password)}")
    return urlunsplit((parts.scheme.lower(), hostport, parts.path, "", "")), credentials


def _check_credential_options(options: dict, url: str | None, where: str) -> None:
    """``api_key_env`` names an environment variable; ``ca_bundle`` is a file; both need an attach url.
    A key given in the clear (``api_key=...``) is refused: it would be written into the results."""
    for key in options:
        if key.lower() in SECRET_OPTIONS:
            raise ConfigError(f"option {key!r} in {where} would write a secret into the results: put it in an "
                              f"environment variable and give its name, api_key_env=NAME")
    if "api_key_env" in options:
        name = str(options["api_key_env"])
        if not _ENV_NAME.fullmatch(name):
            # not shown: a key pasted here by mistake would reach the console
            raise ConfigError(f"api_key_env in {where.replace(name, '***')} must be the name of an environment "
                              f"variable (letters, digits and _, not starting with a digit)")
        if url is None:
            raise ConfigError(f"api_key_env in {where} is for a server kvbench attaches to: give url=...")
        options["api_key_env"] = name
    if "ca_bundle" in options:
        path = Path(str(options["ca_bundle"])).expanduser()
        if url is None or not url.startswith("https://"):
            raise ConfigError(f"ca_bundle in {where} is for an https url (url=https://...)")
        if not path.is_file():
            raise ConfigError(f"ca_bundle={options['ca_bundle']} in {where}: no such file (a PEM file of CA "
                              f"certificates)")
        options["ca_bundle"] = str(path)


def check_options(engine: str, options: dict) -> dict:
    """The options checked against the engine's declaration (its adapter's ``option_specs``), typed."""
    try:
        return validate(engine, REGISTRY[engine], options)
    except OptionError as exc:
        raise ConfigError(str(exc)) from None


def parse_options(text: str, where: str) -> dict:
    """``KEY=VALUE,KEY=VALUE`` as a dict, values as bool, int, float or str."""
    options = {}
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"option {item!r} in {where} must be KEY=VALUE")
        options[key.strip()] = _scalar(value.strip())
    return options


def _scalar(value: str):
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value
