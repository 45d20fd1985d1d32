"""Where each file of an uploaded zip goes in the dataset, and which files are left out (and why).

Two layouts: ImageFolder (``<class>/<image>``, one wrapping folder stripped when that is what the
zip holds), which torchvision reads as is and training needs; and unlabelled (every file at its own
path, any depth up to a bound), what a batch-prediction job labels. Only names are decided here:
the entries have already passed core/zip_safety.py, and core/archives.py writes the planned files
and keeps those that decode. A misplaced file is not an error: it is skipped and listed for the
user, since one stray README should not cost a whole upload.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.zip_safety import ZipMember

__all__ = ["MAX_UNLABELED_DEPTH", "Plan", "SkippedFile", "plan_image_folder", "plan_unlabeled"]

# A single path component longer than this cannot be created on common filesystems.
_MAX_NAME_BYTES = 255
# Clutter that archivers and desktops add; dropped without being reported.
_JUNK_NAMES = frozenset({"__macosx", "thumbs.db", "desktop.ini"})
# An unlabelled upload keeps its folders; deeper than this is not a photo library, it is an attack.
MAX_UNLABELED_DEPTH = 32


@dataclass(frozen=True)
class SkippedFile:
    """A file that was left out of the dataset, and why (shown to the user)."""

    path: str  # path inside the archive
    reason: str


# Each kept member with the path (components under the dataset's root) it is written to.
Plan = list[tuple[ZipMember, tuple[str, ...]]]


def plan_image_folder(members: list[ZipMember]) -> tuple[Plan, list[SkippedFile]]:
    """Map each file to ``(member, (class, filename))``; misplaced files become skipped.

    One common top-level folder (``PetImages/Cat/1.jpg``) is stripped when that puts more
    files at ``<class>/<image>`` depth than leaving it would, so a single-class zip
    (``Cat/1.jpg``) is not mistaken for a wrapper.
    """
    files = [m for m in members if not _is_junk(m.parts)]
    tops = {m.parts[0] for m in files}
    strip = 0
    if len(tops) == 1 and all(len(m.parts) >= 2 for m in files):
        at_depth_if_stripped = sum(len(m.parts) == 3 for m in files)
        at_depth_as_is = sum(len(m.parts) == 2 for m in files)
        if at_depth_if_stripped > at_depth_as_is:
            strip = 1

    plan: Plan = []
    skipped: list[SkippedFile] = []
    for m in files:
        parts = m.parts[strip:]
        path = m.info.orig_filename
        if len(parts) == 1:
            skipped.append(SkippedFile(path, "file at the top level; images must be in a <class>/ folder"))
        elif len(parts) > 2:
            skipped.append(SkippedFile(path, "nested too deep; expected <class>/<image>"))
        elif not _is_safe_component(parts[0]):
            skipped.append(SkippedFile(path, "class folder name is not a usable directory name"))
        elif not _is_safe_component(parts[1]):
            skipped.append(SkippedFile(path, "file name is not usable"))
        else:
            plan.append((m, (parts[0], parts[1])))
    return plan, skipped


def plan_unlabeled(members: list[ZipMember]) -> tuple[Plan, list[SkippedFile]]:
    """Every file at its own path (any depth); a name that cannot be created is skipped. There are
    no classes: the extraction reports only how many images it kept."""
    plan: Plan = []
    skipped: list[SkippedFile] = []
    for m in (m for m in members if not _is_junk(m.parts)):
        path = m.info.orig_filename
        if len(m.parts) > MAX_UNLABELED_DEPTH:
            skipped.append(SkippedFile(path, f"nested deeper than {MAX_UNLABELED_DEPTH} folders"))
        elif not all(_is_safe_component(part) for part in m.parts):
            skipped.append(SkippedFile(path, "file or folder name is not usable"))
        else:
            plan.append((m, m.parts))
    return plan, skipped


def _is_junk(parts: tuple[str, ...]) -> bool:
    """Archiver and desktop clutter (``__MACOSX/``, dotfiles, Thumbs.db), never reported."""
    return any(part.startswith(".") or part.lower() in _JUNK_NAMES for part in parts)


def _is_safe_component(part: str) -> bool:
    """True for a name that is exactly one creatable path component."""
    return (
        part not in ("", ".", "..")
        and "/" not in part
        and "\\" not in part
        and "\x00" not in part
        and len(part.encode("utf-8", "surrogateescape")) <= _MAX_NAME_BYTES
    )
