"""The model catalogue: real models with the source of their numbers, read by every command and notebook.

``course/data/kv_models.json`` holds each model's config.json keys (copied with their original
names), its Hub id, its parameter count or how it is derived, and where the numbers come from.
``course kv``, ``course simulate --model`` and the notebooks all look models up here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from course.geometry import ModelGeometry, from_hf_config, read_config_json
from course.kv.params import count_params

CATALOGUE_FILE = Path(__file__).parent.parent / "data" / "kv_models.json"


@dataclass(frozen=True)
class CatalogueEntry:
    """A real model: its config.json keys, where they come from, and its parameter count."""

    name: str
    hf_id: str
    config: dict
    num_params: int
    params_source: str
    source: str

    @property
    def geometry(self) -> ModelGeometry:
        g = from_hf_config(self.config, name=self.name, num_params=self.num_params)
        return replace(g, source=self.source)


@cache
def _catalogue() -> dict[str, CatalogueEntry]:
    raw = json.loads(CATALOGUE_FILE.read_text())
    entries = {}
    for item in raw["models"]:
        params = item["num_params"] or count_params(item["config"])
        if params is None:
            raise ValueError(f"catalogue entry {item['name']}: no num_params and count_params cannot derive it")
        entries[item["name"]] = CatalogueEntry(
            item["name"], item["hf_id"], item["config"], params, item["params_source"], item["source"]
        )
    return entries


def catalogue() -> dict[str, CatalogueEntry]:
    """Every catalogue entry by name."""
    return dict(_catalogue())


def _normalise(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum() or ch == ".")


def catalogue_entry(name: str) -> CatalogueEntry:
    """The catalogue entry called ``name`` (case and punctuation ignored; the Hub id works too)."""
    wanted = _normalise(name)
    for entry in _catalogue().values():
        if wanted in (_normalise(entry.name), _normalise(entry.hf_id), _normalise(entry.hf_id.split("/")[-1])):
            return entry
    raise ValueError(f"model: unknown {name!r}; catalogue models: {', '.join(_catalogue())} (or a config.json path)")


def _looks_like_a_path(text: str) -> bool:
    return text.endswith(".json") or text.startswith((".", "/", "~")) or Path(text).exists()


def get_model(spec: str | Path | dict | ModelGeometry, num_params: int | None = None) -> ModelGeometry:
    """Geometry of a catalogue model (by name), a config.json (path, folder or dict) or a geometry.

    For a config without a known parameter count, :func:`count_params` derives it where it can.
    Errors name the file and the field: a missing file or folder, malformed JSON, a JSON value that
    is not an object, a field that is missing or not a positive integer.
    """
    if isinstance(spec, ModelGeometry):
        return spec
    if isinstance(spec, dict):
        return from_hf_config(spec, num_params=num_params or count_params(spec))
    text = str(spec)
    if not isinstance(spec, Path) and not _looks_like_a_path(text):
        try:
            return catalogue_entry(text).geometry
        except ValueError:
            if "/" not in text:  # a plain name: the catalogue was meant
                raise
    path = Path(spec).expanduser()
    file, cfg = read_config_json(path, label="model", instead="a catalogue name (course kv --list)")
    name = cfg.get("_name_or_path") or (path.stem if path.is_file() else path.name)
    try:
        g = from_hf_config(cfg, name=name, num_params=num_params or count_params(cfg))
    except (ValueError, TypeError) as err:
        raise ValueError(f"{file}: {err}") from None
    return replace(g, source=str(path))


def models() -> dict[str, ModelGeometry]:
    """Every catalogue model's geometry, by name."""
    return {name: entry.geometry for name, entry in _catalogue().items()}
