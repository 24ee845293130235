"""Each service's settings: one typed pydantic object holding its defaults and its
validation, filled from an optional --config file (YAML or TOML), from
FLAGSTOP_<SERVICE>_<FLAG> environment variables and from flags, each overriding the
one before, all through the same validation. pydantic-settings reads the three
sources; what this module adds is the one line a person can act on when a value is
bad, naming where the value came from (flag, variable or file key)."""

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

Port = Annotated[int, Field(ge=0, le=65535)]


class SettingsInvalid(ValueError):
    """A bad setting; the message is the one line to print before exiting."""


class ServiceSettings(BaseSettings):
    """What every flagstop server takes. Subclasses set env_prefix and cli_prog_name
    in their model_config."""

    model_config = SettingsConfigDict(
        extra="forbid", frozen=True, use_attribute_docstrings=True, cli_kebab_case=True,
        cli_implicit_flags="toggle", cli_hide_none_type=True, cli_exit_on_error=False,
        cli_use_class_docs_for_groups=False,
    )  # fmt: skip

    config: Path | None = None
    """a YAML or TOML file of settings, keyed by flag name (flags and variables win)"""
    host: str = "127.0.0.1"
    """address to listen on (compose and Kubernetes set 0.0.0.0)"""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    log_format: Literal["text", "json"] = "text"
    """json: one object per line, with the trace_id and span_id of the current span"""
    tls_cert: Path | None = None
    """PEM certificate: served, and shown to servers"""
    tls_key: Path | None = None
    """PEM private key of --tls-cert"""
    tls_ca: Path | None = None
    """PEM CA that peers' certificates must chain to"""

    @model_validator(mode="after")
    def _tls_files_together(self) -> Self:
        paths = (self.tls_cert, self.tls_key, self.tls_ca)
        if any(paths) and not all(paths):
            raise ValueError("--tls-cert, --tls-key and --tls-ca are needed together")
        for path in filter(None, paths):
            if not path.is_file():
                raise ValueError(f"TLS file {path} does not exist")
        return self

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        **others: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:  # fmt: skip
        # load() gathers the sources itself (to name them in errors); construction
        # validates only what it is given.
        return (init_settings,)

    @classmethod
    def prog(cls) -> str:
        return cls.model_config.get("cli_prog_name") or "flagstop"

    @classmethod
    def load(cls, argv: list[str] | None = None) -> Self:
        """From the command line (argv), the environment and the --config file;
        raises SettingsInvalid with one line."""
        origins = _Origins(cls)
        values = origins.gather(argv)
        try:
            return cls(**values)
        except ValidationError as e:
            raise SettingsInvalid(origins.explain(e)) from None


def config_from(settings: ServiceSettings, config_cls: type, **resolved: Any):
    """A core's config from a service's settings, the one way every service maps
    them: each field of the config takes the setting of the same name, by keyword;
    resolved gives the fields only known at run time (what the executor described).
    A config field without a setting of its name keeps its default."""
    if dataclasses.is_dataclass(config_cls):
        names = [f.name for f in dataclasses.fields(config_cls)]
    else:  # a pydantic model
        names = list(config_cls.model_fields)
    given = type(settings).model_fields
    values = {n: getattr(settings, n) for n in names if n in given and n not in resolved}
    return config_cls(**values, **resolved)


class _Origins:
    """The raw values of each source, and where each field's value came from."""

    def __init__(self, cls: type[ServiceSettings]) -> None:
        self.cls = cls
        self.where: dict[str, str] = {}

    def gather(self, argv: list[str] | None) -> dict[str, Any]:
        cli, env = self._cli(argv), self._env()
        path = cli.get("config") or env.get("config")
        file = self._file(Path(path)) if path else {}
        # In rising precedence, as the values are merged.
        for field, value in file.items():
            self.where[field] = f"{path}: {field}: {value}"
        prefix = self.cls.model_config["env_prefix"]
        for field, value in env.items():
            name = prefix + field.upper()
            self.where[field] = f"{name}={os.environ.get(name, value)}"
        for field, value in cli.items():
            self.where[field] = f"--{field.replace('_', '-')} {value}"
        return {**file, **env, **cli}

    def _cli(self, argv: list[str] | None) -> dict[str, Any]:
        source = CliSettingsSource(self.cls, cli_show_env_vars=True)
        try:
            return source(args=list(argv or []))()
        except SettingsError as e:
            raise SettingsInvalid(str(e).removeprefix("error parsing CLI: ")) from None

    def _env(self) -> dict[str, Any]:
        prefix, fields = self.cls.model_config["env_prefix"], self.cls.model_fields
        unknown = [
            name for name in os.environ
            if name.startswith(prefix) and name[len(prefix):].lower() not in fields
        ]  # fmt: skip
        if unknown:
            raise SettingsInvalid(f"{unknown[0]} is not a setting of {self.cls.prog()}")
        return EnvSettingsSource(self.cls, env_prefix=prefix)()

    def _file(self, path: Path) -> dict[str, Any]:
        try:
            text = path.read_text()
            data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
        except (OSError, tomllib.TOMLDecodeError, yaml.YAMLError) as e:
            raise SettingsInvalid(f"--config {path}: {_first_line(e)}") from None
        if not isinstance(data, dict):
            raise SettingsInvalid(f"--config {path}: expected a mapping of setting: value")
        return {str(key).replace("-", "_"): value for key, value in data.items()}

    def explain(self, error: ValidationError) -> str:
        problems = []
        for e in error.errors():
            message = e["msg"].removeprefix("Value error, ")
            if e["type"] == "extra_forbidden":
                message = f"not a setting of {self.cls.prog()}"
            field = str(e["loc"][0]) if e["loc"] else ""
            if field:
                problems.append(f"{self.where.get(field, field)}: {message}")
            else:
                problems.append(message)
        return "; ".join(problems)


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
