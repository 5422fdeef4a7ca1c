"""What the launcher finds under an image folder: splits, class folders, stray files, odd entries."""

from __future__ import annotations

import os

from formats.storage import files as fs
from pipelines.core import inputs
from pipelines.core.records import Reject

DEFAULT_SPLIT = "train"


class InputLayout:
  """What the launcher found under the input: splits, classes, stray files, odd entries.

  Names are kept as the OS gives them (surrogate escapes for non-UTF-8 bytes);
  class names, labels and file names are their printable forms (`inputs.printable`).
  """

  def __init__(self, root: str, layout: str):
    self.root = root
    dirs, root_files, root_others = inputs.scan_input(root)
    below, unreadable = {}, {}
    for d in dirs:  # each split's class folders: no two of the whole input may overlap
      try:
        below[d] = inputs.scan_level(fs.join(root, d), root,
                                     [os.path.realpath(fs.join(root, e)) for e in dirs if e != d])
      except OSError as e:  # a class folder (its own listing rejects it) or an odd entry
        unreadable[d] = inputs.unreadable_folder(e)
    if layout == "auto":
      layout = "splits" if below and all(classes for classes, _, _ in below.values()) else "classes"
    self.layout = layout
    self.class_dirs: dict[str, list[str]] = {}  # split -> class folder names
    self.stray_files = [fs.join(root, f) for f in root_files]
    self.odd_entries = [(fs.join(root, f), reason) for f, reason in root_others]
    if layout == "classes":
      self.class_dirs[DEFAULT_SPLIT] = dirs
    else:
      self.odd_entries += [(fs.join(root, d), reason) for d, reason in unreadable.items()]
      for split in below:
        classes, files, others = below[split]
        self.class_dirs[split] = classes
        self.stray_files += [fs.join(root, split, f) for f in files]
        self.odd_entries += [(fs.join(root, split, f), reason) for f, reason in others]
    self.class_names = sorted({inputs.printable(c) for cs in self.class_dirs.values() for c in cs})

  def folder(self, split: str, cls: str) -> str:
    """The path of class folder `cls` of `split`, by the layout (classes, or splits of classes).

    Args:
      split: the split's name.
      cls: the class folder's name, as listed.

    Returns:
      The folder's path below the input root.
    """
    return fs.join(self.root, cls) if self.layout == "classes" else fs.join(self.root, split, cls)

  def num_undecodable(self) -> int:
    """Launcher rejects and class folders whose names are not valid UTF-8.

    Returns:
      How many there are, for the manifest's warning.
    """
    names = [*self.stray_files, *(f for f, _ in self.odd_entries), *(c for cs in self.class_dirs.values() for c in cs)]
    return sum(1 for n in names if inputs.printable(n) != n)

  def launcher_rejects(self) -> list[Reject]:
    """Files outside class folders and entries that are no file or folder.

    Returns:
      One `Reject` each, with printable paths.
    """
    return ([Reject(inputs.printable(f), "not inside a class folder") for f in self.stray_files]
            + [Reject(inputs.printable(f), reason) for f, reason in self.odd_entries])
