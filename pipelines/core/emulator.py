"""Beam's GCS client against the storage emulator (tests, local development).

With STORAGE_EMULATOR_HOST set, Beam's FileSystems must talk to the emulator
anonymously: Beam otherwise looks for Google credentials first and retries
with back-off for about 25 s per process before giving up. google-cloud-storage
(formats.storage.files) honours the variable on its own.
"""

from __future__ import annotations

import os


def use_anonymous_credentials() -> None:
  """Tells Beam's GCS client to use no credentials when STORAGE_EMULATOR_HOST is set."""
  if not os.environ.get("STORAGE_EMULATOR_HOST"):
    return
  # No public way exists in Beam 2.77: GcsFileSystem makes its GcsIO without a client, and GcsIO builds one from
  # apache_beam.internal.gcp.auth.get_service_credentials ("for internal use only"), which tries
  # google.auth.default 5 times with exponential back-off from 2 s (with_exponential_backoff(num_retries=4))
  # before it connects anonymously. --no_auth is read by the Dataflow runner's API client only, not by GcsIO;
  # NO_GCE_CHECK and the like shorten google-auth's own probe, not Beam's back-off around it. So the credentials
  # Beam caches per process are set to "none, already looked up", the state its own failed lookup ends in.
  from apache_beam.internal.gcp import auth

  with auth._Credentials._credentials_lock:
    auth._Credentials._credentials = None
    auth._Credentials._credentials_init = True
