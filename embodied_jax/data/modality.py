"""GR00T-style ``meta/modality.json``: named slices of state/action, camera renames, annotation keys.

The file looks like::

    {"state":  {"arm": {"start": 0, "end": 6}, "gripper": {"start": 6, "end": 7}},
     "action": {"arm": {"start": 0, "end": 6}, ...},
     "video":  {"front": {"original_key": "observation.images.front"}},
     "annotation": {"human.task_description": {"original_key": "task_index"}}}

`Modality.split` adds ``state.<name>``, ``action.<name>``, ``video.<name>`` and
``annotation.<name>`` entries to a sample, leaving the original keys in place.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

STATE_KEY = "observation.state"
ACTION_KEY = "action"


@dataclasses.dataclass(frozen=True)
class Modality:
    state: Mapping[str, tuple[int, int]]
    action: Mapping[str, tuple[int, int]]
    video: Mapping[str, str]
    annotation: Mapping[str, str]
    state_key: str = STATE_KEY
    action_key: str = ACTION_KEY

    @classmethod
    def from_json(cls, payload: Mapping[str, Any], *, source: str = "modality.json") -> Modality:
        def slices(section: str) -> dict[str, tuple[int, int]]:
            out = {}
            for name, spec in payload.get(section, {}).items():
                if not isinstance(spec, Mapping) or "start" not in spec or "end" not in spec:
                    raise ValueError(f"{source}: {section}.{name} needs 'start' and 'end', got {spec!r}")
                start, end = int(spec["start"]), int(spec["end"])
                if not 0 <= start < end:
                    raise ValueError(f"{source}: {section}.{name} has an empty or negative slice [{start}, {end})")
                out[name] = (start, end)
            return out

        def renames(section: str, default_prefix: str) -> dict[str, str]:
            out = {}
            for name, spec in payload.get(section, {}).items():
                spec = spec or {}
                out[name] = str(spec.get("original_key", default_prefix + name))
            return out

        state_keys = {spec.get("original_key") for spec in payload.get("state", {}).values()} - {None}
        action_keys = {spec.get("original_key") for spec in payload.get("action", {}).values()} - {None}
        return cls(
            state=slices("state"),
            action=slices("action"),
            video=renames("video", "observation.images."),
            annotation=renames("annotation", "annotation."),
            state_key=state_keys.pop() if len(state_keys) == 1 else STATE_KEY,
            action_key=action_keys.pop() if len(action_keys) == 1 else ACTION_KEY,
        )

    def to_json(self) -> dict[str, Any]:
        """The ``modality.json`` payload that ``from_json`` reads back as this object."""

        def slices(section: Mapping[str, tuple[int, int]], key: str) -> dict[str, dict]:
            return {name: {"start": start, "end": end, "original_key": key} for name, (start, end) in section.items()}

        return {
            "state": slices(self.state, self.state_key),
            "action": slices(self.action, self.action_key),
            "video": {name: {"original_key": key} for name, key in self.video.items()},
            "annotation": {name: {"original_key": key} for name, key in self.annotation.items()},
        }

    @classmethod
    def load(cls, path: str | pathlib.Path) -> Modality:
        path = pathlib.Path(path)
        try:
            payload = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot read modality file ({exc})") from exc
        return cls.from_json(payload, source=str(path))

    def validate(self, features: Mapping[str, Mapping[str, Any]], *, source: str) -> None:
        """Checks that the slices fit the feature widths and renamed keys exist."""
        for section, key, slices in (("state", self.state_key, self.state), ("action", self.action_key, self.action)):
            if not slices:
                continue
            if key not in features:
                raise ValueError(f"{source}: modality {section} refers to {key!r}, which the dataset lacks")
            width = int(features[key]["shape"][0])
            for name, (start, end) in slices.items():
                if end > width:
                    raise ValueError(
                        f"{source}: modality {section}.{name} = [{start}, {end}) exceeds {key!r} width {width}"
                    )
        for name, key in self.video.items():
            if key not in features:
                raise ValueError(f"{source}: modality video.{name} refers to {key!r}, which the dataset lacks")

    def annotation_columns(self) -> Sequence[str]:
        return tuple(self.annotation.values())

    def split(self, sample: dict[str, Any], tasks: Sequence[str]) -> dict[str, Any]:
        """Adds the named modality views of `sample` (arrays with the feature on the last axis)."""
        out = dict(sample)
        for name, (start, end) in self.state.items():
            if self.state_key in sample:
                out[f"state.{name}"] = sample[self.state_key][..., start:end]
        for name, (start, end) in self.action.items():
            if self.action_key in sample:
                out[f"action.{name}"] = sample[self.action_key][..., start:end]
        for name, key in self.video.items():
            if key in sample:
                out[f"video.{name}"] = sample[key]
        for name, key in self.annotation.items():
            if key in sample:
                out[f"annotation.{name}"] = tasks[int(sample[key])]
        return out
