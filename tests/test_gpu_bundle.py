"""What the GPU check carries to the lent machine (`benchmarks/gpu_bundle/`): the image it mirrors is within the
package's floors, and the bundle's wheels are releases the package accepts, with no flwr and no ray (`make
gpu-rehearsal` runs the check on that image with that bundle; this checks the declarations it starts from)."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests import REPO

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

BUNDLE = REPO / "benchmarks" / "gpu_bundle"


def _pins(path: Path) -> dict[str, str]:
    """name -> pinned version of a requirements file's `NAME==VERSION` lines (comments and unpinned names skipped)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            req = Requirement(line)
            pins[req.name.lower()] = next(iter(req.specifier)).version
    return pins


def _declared() -> dict[str, Requirement]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {req.name.lower(): req for req in map(Requirement, deps)}


def test_the_images_torch_and_transformers_are_within_the_packages_floors():
    image, declared = _pins(BUNDLE / "image.txt"), _declared()
    for name in ("torch", "transformers", "tokenizers", "safetensors"):
        assert declared[name].specifier.contains(image[name]), (name, image[name], str(declared[name]))


def test_the_bundle_carries_releases_the_package_accepts_and_neither_flwr_nor_ray():
    bundle, declared, image = _pins(BUNDLE / "requirements.txt"), _declared(), _pins(BUNDLE / "image.txt")
    assert bundle and not {"flwr", "ray"} & set(bundle)
    assert not set(bundle) & set(image), "the bundle carries what the image has"
    for name, version in bundle.items():
        if name in declared:
            assert declared[name].specifier.contains(version), (name, version, str(declared[name]))

