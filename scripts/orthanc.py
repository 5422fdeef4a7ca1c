"""A real DICOM store for the tests and the benchmark: Orthanc with its DICOMweb plugin, on loopback.

    with Orthanc(tmp_dir) as store:        # starts it on a free port, waits until it answers
      accepted = store.upload(paths)       # POST /instances; what the store took, by path
      store.dicomweb                       # http://127.0.0.1:PORT/dicom-web

Debian's `orthanc` and `orthanc-dicomweb` packages (scripts/run_tests.sh installs them).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import uuid

import requests

BINARY = shutil.which("Orthanc") or "/usr/sbin/Orthanc"
PLUGIN = "/usr/share/orthanc/plugins/libOrthancDicomWeb.so"


def available() -> bool:
  """Whether Orthanc and its DICOMweb plugin are installed."""
  return os.path.exists(BINARY) and os.path.exists(PLUGIN)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Orthanc:
  """One Orthanc process with its own storage under `root`; with `users` ({name: password}), HTTP basic auth."""

  def __init__(self, root: str, users: dict[str, str] | None = None):
    self.root = root
    os.makedirs(root, exist_ok=True)
    self._auth = next(iter(users.items())) if users else None
    self._log = open(os.path.join(root, "orthanc.log"), "wb")
    for _ in range(5):  # a port picked free may be taken before Orthanc binds it: then another one
      if self._start(users):
        return
    raise RuntimeError(f"Orthanc did not start (see {root}/orthanc.log)")

  def _start(self, users: dict[str, str] | None) -> bool:
    """Starts Orthanc on a free port; True once it answers as itself (its own name: not another test's)."""
    self.port = _free_port()
    name = f"tests-{uuid.uuid4().hex[:12]}"
    config = {
        "Name": name, "StorageDirectory": os.path.join(self.root, "db"), "IndexDirectory": os.path.join(self.root, "db"),
        "HttpPort": self.port, "DicomServerEnabled": False, "DicomPort": _free_port(),
        "RemoteAccessAllowed": False, "AuthenticationEnabled": bool(users), "RegisteredUsers": users or {},
        "StorageCompression": False,
        "Plugins": [PLUGIN], "DicomWeb": {"Enable": True, "Root": "/dicom-web/"},
    }
    self._config = os.path.join(self.root, "orthanc.json")
    with open(self._config, "w") as f:
      json.dump(config, f)
    self.url = f"http://127.0.0.1:{self.port}"
    self.dicomweb = f"{self.url}/dicom-web"
    self._proc = subprocess.Popen([BINARY, self._config], stdout=self._log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
      try:
        r = requests.get(f"{self.url}/system", timeout=2, auth=self._auth)
        if r.ok and r.json().get("Name") == name:
          return True
      except (requests.ConnectionError, ValueError):
        pass
      if self._proc.poll() is not None:
        return False
      time.sleep(0.1)
    self._proc.kill()
    self._proc.wait()
    return False

  def upload(self, paths) -> dict[str, str]:
    """POSTs each file; returns {path: Orthanc's instance ID} of those it stored (a file it refuses, or an
    instance it already holds, is left out)."""
    stored = {}
    with requests.Session() as s:
      for path in paths:
        with open(path, "rb") as f:
          r = s.post(f"{self.url}/instances", data=f.read(), timeout=60, auth=self._auth)
        if r.ok and r.json().get("Status") == "Success":
          stored[path] = r.json()["ID"]
    return stored

  def delete_instance(self, instance_id: str) -> None:
    requests.delete(f"{self.url}/instances/{instance_id}", timeout=30, auth=self._auth).raise_for_status()

  def close(self) -> None:
    self._proc.terminate()
    try:
      self._proc.wait(10)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait()
    self._log.close()

  def __enter__(self) -> Orthanc:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
