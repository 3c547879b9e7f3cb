"""Typed configuration of a run: which backends (engine + version + options), model, workload."""
from __future__ import annotations

import base64
import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import BaseModel, Field, SecretStr, model_validator

from kvbench.backends import REGISTRY
from kvbench.backends.options import OptionError, validate
from kvbench.common.files import PlainNameError, check_plain_name
from kvbench.common.redact import (SECRET_NAME, SECRET_OPTIONS, hold_secret, hold_userinfo, host_port,
                                   redact_text)
from kvbench.common.suggest import hint as did_you_mean


class ConfigError(ValueError):
    pass


class BackendConfig(BaseModel):
    """One engine at one version. The version picks the isolated environment, so two versions of one
    engine can run in the same run (``vllm@0.31.0`` and ``vllm@0.32.0``)."""

    engine: str
    version: str
    options: dict = Field(default_factory=dict)
    url: str | None = None  # attach to a server already running there instead of starting one (no userinfo)
    #: Every endpoint attached to (no userinfo): ``[url]`` for one server; two or more make a deployment of
    #: replicas of one engine (backends/deployment.py), each read for its own KV pool, KV in use and queue.
    urls: list[str] = Field(default_factory=list)
    #: A deployment's requests all go here (a load balancer, a Kubernetes service) instead of round-robin
    #: over ``urls``; the ``urls`` are then read only for each replica's KV and queue.
    gateway: str | None = None
    #: ``user:password`` from the url's userinfo, sent as HTTP basic auth; never dumped, shown or written.
    #: One set for the whole backend: every url (and the gateway) is sent the same credentials.
    credentials: SecretStr | None = Field(default=None, exclude=True, repr=False)
    #: Set where one run has two settings of one engine (:func:`distinct_labels`): the options that tell
    #: them apart, so that each gets its own label, cell ids and log.
    setting: str = ""

    @model_validator(mode="after")
    def _one_list_of_endpoints(self) -> "BackendConfig":
        """``url`` and ``urls`` say the same thing: ``url`` is the first of ``urls``."""
        if self.urls and self.url is None:
            self.url = self.urls[0]
        elif self.url is not None and not self.urls:
            self.urls = [self.url]
        return self

    @property
    def deployment(self) -> bool:
        """Several replicas (or a gateway in front of them): benchmarked as one deployment."""
        return len(self.urls) > 1 or self.gateway is not None

    @property
    def label(self) -> str:
        if self.gateway:
            return f"{self.engine}@{host_port(self.gateway)}+{len(self.urls)}-replicas"
        if self.deployment:
            return f"{self.engine}@" + "+".join(host_port(u) for u in self.urls)
        if self.url:
            return f"{self.engine}@{host_port(self.url)}" + (f"+{self.setting}" if self.setting else "")
        return f"{self.engine}-{self.version}" + (f"+{self.setting}" if self.setting else "")

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
            if not (value.isascii() and value.isprintable()):  # the character itself is not shown
                where = next(i for i, c in enumerate(value) if not (c.isascii() and c.isprintable()))
                raise ConfigError(f"api_key_env={name}: the value of {name} holds a character that is not "
                                  f"printable ASCII (at position {where + 1} of {len(value)}), which an HTTP "
                                  f"header cannot carry: check the variable")
            hold_secret(value)  # masked from here on in whatever a server sends back
            return {"Authorization": f"Bearer {value}"}
        if self.credentials is not None:
            user, _, password = self.credentials.get_secret_value().partition(":")
            hold_userinfo(user, password)
            token = base64.b64encode(self.credentials.get_secret_value().encode()).decode()
            return {"Authorization": f"Basic {token}"}
        return {}

    @classmethod
    def parse(cls, text: str) -> "BackendConfig":
        """``ENGINE[@VERSION][:KEY=VALUE,...]``, e.g. ``vllm``, ``vllm@0.32.0``, ``llamacpp:threads=2``.
        ``url`` may be given more than once: the replicas of a deployment (``vllm:url=http://a:8000,
        url=http://b:8000``), optionally behind ``gateway=URL``; any other key only once."""
        head, _, opts = text.partition(":")
        engine, _, version = head.partition("@")
        engine = engine.strip().lower()
        if engine not in REGISTRY:
            raise ConfigError(f"backend {engine!r} is not known; {did_you_mean(engine, REGISTRY)}allowed: {', '.join(sorted(REGISTRY))}")
        if version:
            try:  # the version names the engine's environment folder and is in the label, hence file names
                check_plain_name(version.strip(), f"the version of {engine}")
            except PlainNameError as exc:
                raise ConfigError(str(exc)) from None
        # each option redacted on its own: a url's userinfo must not hide in the next option's url
        where = repr(",".join(redact_text(part) for part in text.split(",")))
        options = parse_options(opts, where, repeatable=("url",))
        urls, credentials = _split_urls(options.pop("url", []), where)
        gateway, gateway_credentials = _split_url(options.pop("gateway", None), where)
        if gateway is not None and not urls:
            raise ConfigError(f"gateway in {where} needs the replicas behind it: give url=... for each (their "
                              f"/metrics are read for each replica's KV and queue)")
        credentials = _one_credential([credentials, gateway_credentials], where)
        _check_credential_options(options, urls[0] if urls else None, where, [*urls, *filter(None, [gateway])])
        options = check_options(engine, options)
        if urls and str(options.get("speculative", "none")) != "none":
            raise ConfigError(f"speculative in {where}: an attached server's drafter is its operator's (its "
                              "counters are read all the same): leave speculative out")
        cfg = cls(engine=engine, version=version.strip() or REGISTRY[engine].default_version, options=options,
                  urls=urls, gateway=gateway, credentials=credentials)
        cfg.auth_headers()  # an unset api_key_env variable is an error now, not in the middle of the run
        return cfg


def check_attachable(configs: list[BackendConfig]) -> None:
    """ConfigError (one line, before anything is installed or a run folder made) for a backend that only
    attaches to a running server (``Backend.attach_only``) but was given no url."""
    for cfg in configs:
        if not cfg.urls and (why := REGISTRY[cfg.engine].attach_only):
            raise ConfigError(why)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def url_problem(text: str) -> str | None:
    """What makes ``text`` no http(s) URL to connect to (a scheme, a host, a port 1-65535 when a ``:``
    is given: ``http://host:`` would otherwise mean port 80), or None."""
    try:
        parts = urlsplit(str(text))
        port = parts.port  # raises ValueError for a port that is not a number or above 65535
    except ValueError:
        return "must look like http://host:port or https://host[:port][/path] (a port is 1-65535)"
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        return "must look like http://host:port or https://host[:port][/path]"
    if parts.netloc.endswith(":"):
        return "has no port after the ':' (a port is 1-65535): give one, or leave the ':' out"
    if port == 0:
        return "has port 0: a port is 1-65535"
    return None


def _split_url(value, where: str) -> tuple[str | None, SecretStr | None]:
    """The url option as (url without userinfo, ``user:password`` from its userinfo or None)."""
    if value is None:
        return None, None
    if problem := url_problem(str(value)):
        raise ConfigError(f"the url in {where} {problem}")
    parts = urlsplit(str(value))
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


def _split_urls(values: list, where: str) -> tuple[list[str], SecretStr | None]:
    """Every ``url`` option (the replicas of a deployment) without userinfo, and the one ``user:password``
    they carry (the same on every url that has one; a url without userinfo is sent it too)."""
    urls, credentials = [], []
    for value in values:
        url, secret = _split_url(value, where)
        if url in urls:
            raise ConfigError(f"the url {url} is given twice in {where}")
        if any(host_port(u) == host_port(url) for u in urls):
            # a replica is named by its host:port in the rows and file names
            raise ConfigError(f"two urls in {where} share the host:port {host_port(url)}: each replica must "
                              f"have a host:port of its own")
        urls.append(url)
        credentials.append(secret)
    return urls, _one_credential(credentials, where)


def _one_credential(secrets: list[SecretStr | None], where: str) -> SecretStr | None:
    """The one ``user:password`` of a backend's urls; different ones on different urls are refused (every
    request of a backend carries the same credentials), without showing either."""
    given = {s.get_secret_value() for s in secrets if s is not None}
    if len(given) > 1:
        raise ConfigError(f"the urls in {where} carry different credentials: a backend sends one set to all "
                          f"its urls (give it on one url, or api_key_env=NAME)")
    return SecretStr(given.pop()) if given else None


def _check_credential_options(options: dict, url: str | None, where: str, urls: list[str] | None = None) -> None:
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
        if url is None or not any(u.startswith("https://") for u in urls or [url]):
            raise ConfigError(f"ca_bundle in {where} is for an https url (url=https://...)")
        if not path.is_file():
            raise ConfigError(f"ca_bundle={options['ca_bundle']} in {where}: no such file (a PEM file of CA "
                              f"certificates)")
        options["ca_bundle"] = str(path)


def check_options(engine: str, options: dict) -> dict:
    """The options checked against the engine's declaration (its adapter's ``option_specs``), typed."""
    try:
        options = validate(engine, REGISTRY[engine], options)
        REGISTRY[engine].capabilities.speculation.check(engine, options)  # the drafter's options together
        return options
    except (OptionError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def parse_options(text: str, where: str, repeatable: tuple[str, ...] | None = None) -> dict:
    """``KEY=VALUE,KEY=VALUE`` as a dict, values as bool, int, float or str. ``repeatable`` None: a key given
    twice keeps its last value; a tuple: the keys in it are lists of every value given (absent: left
    out), and any other key given twice is an error."""
    options = {}
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(f"option {item!r} in {where} must be KEY=VALUE")
        if repeatable is not None and key in repeatable:
            options.setdefault(key, []).append(_scalar(value.strip()))
            continue
        if repeatable is not None and key in options:
            allowed = f" (only {', '.join(repeatable)} may be given more than once)" if repeatable else ""
            raise ConfigError(f"option {key!r} is given twice in {where}{allowed}")
        options[key] = _scalar(value.strip())
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


def distinct_labels(configs: list[BackendConfig]) -> list[BackendConfig]:
    """The run's backends with one label each: two settings of one engine (``-b llamacpp -b
    'llamacpp:threads=2'``) get the options that differ in their labels (``llamacpp-0.3.36+threads=2``); the
    same backend given twice is refused (ConfigError)."""
    out = list(configs)
    by_label: dict[str, list[int]] = {}
    for i, cfg in enumerate(out):
        by_label.setdefault(cfg.label, []).append(i)
    for label, indices in by_label.items():
        if len(indices) < 2:
            continue
        options = [out[i].options for i in indices]
        if any(options.count(o) > 1 for o in options):
            raise ConfigError(f"backend {label} is given twice with the same settings: give it once")
        keys = sorted({k for o in options for k in o if len({str(p.get(k)) for p in options}) > 1})
        for i in indices:
            tag = ",".join(f"{k}={out[i].options[k]}" for k in keys if k in out[i].options) or "default"
            out[i] = out[i].model_copy(update={"setting": re.sub(r"[^A-Za-z0-9._=,-]", "_", tag)})
    return out
