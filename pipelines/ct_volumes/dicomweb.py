"""A DICOMweb store as the input of ct_volumes: QIDO-RS lists it, WADO-RS retrieves each series whole.

    python -m pipelines.ct_volumes --input=http://orthanc:8042/dicom-web --output=... --id_salt=... \
        --dicomweb_filter='ModalitiesInStudy=CT&StudyDate=20260101-20260131'
    python -m pipelines.ct_volumes --id_salt=... --output=gs://b/ct \
        --input=https://healthcare.googleapis.com/v1/projects/P/locations/L/datasets/D/dicomStores/S/dicomWeb

`Store` is what a worker holds: an authorised `requests` session (google-auth's
`AuthorizedSession` for the Cloud Healthcare API, basic or bearer credentials read from
a file for Orthanc or dcm4chee, or none) and a `dicomweb_client.DICOMwebClient` on it
for the searches. Searches are paged (`limit`/`offset`) until a page comes back empty,
so a store that caps its pages below `page_size` still lists everything.

A series is retrieved in one WADO-RS request in its stored transfer syntax
(`multipart/related; type="application/dicom"; transfer-syntax=*`) and split into the
bytes of its instances here, not by dicomweb-client: the client parses every part with
`pydicom.dcmread` (the converter needs the bytes, as a file gives them, for its own
header and pixel path) and yields nothing for a last part whose closing delimiter never
came, so a cut body would read as a shorter series. Here a body without its closing
delimiter is `TruncatedBody`, transient like a dropped connection.

Every request goes through the toolkit's one retry policy (`formats.storage.retry`):
408, 429, 5xx and dropped or cut connections are retried under the run's
--transient_retry_seconds, then the job fails (dicomweb-client's own retries are off, so
retries happen at one level). 401 and 403 are the credentials' fault and fail the run; a
404 or 410 on a listed series is the store's answer about that series, a reject.

Identifiers never appear in clear in what the run writes or logs: an instance is named
`<store URL>/studies/<hash>/series/<series_id>/instances/<hash>` with the run's salted
hashes (`series_id` is the records' own), and `Series` (the real UIDs, which the requests
need) travels only inside the pipeline.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
import dataclasses
import email.message
import hashlib
import json
import logging
import re
import urllib.parse

from dicomweb_client import DICOMwebClient
from dicomweb_client import session_utils
import google.auth
from google.auth.transport.requests import AuthorizedSession
from pydicom.datadict import tag_for_keyword
import requests

from formats.storage import retry
from pipelines.core import inputs
from pipelines.core.errors import UsageError
from pipelines.ct_volumes.headers import salted_hash

AUTH_MODES = ("auto", "none", "google", "basic", "bearer")
HEALTHCARE_HOST = "healthcare.googleapis.com"
HEALTHCARE_SCOPE = "https://www.googleapis.com/auth/cloud-healthcare"
DEFAULT_PAGE_SIZE = 1000
# What WADO-RS is asked for: every instance as stored (no transcoding by the store).
SERIES_ACCEPT = 'multipart/related; type="application/dicom"; transfer-syntax=*'
# The QIDO-RS query keys a user may not set (the listing sets them) and the series-level
# attributes, which filter the series search of each study instead of the study search.
_RESERVED_KEYS = frozenset({"limit", "offset", "includefield", "fuzzymatching"})
_SERIES_KEYWORDS = ("Modality", "SeriesInstanceUID", "SeriesNumber", "SeriesDescription", "SeriesDate", "SeriesTime",
                    "BodyPartExamined", "ProtocolName", "Laterality", "PerformedProcedureStepStartDate",
                    "PerformedProcedureStepStartTime")
_SERIES_KEYS = frozenset(_SERIES_KEYWORDS) | {f"{tag_for_keyword(k):08X}" for k in _SERIES_KEYWORDS}
_UID = re.compile(r"[0-9]+(\.[0-9]+)*")  # PS3.5 9.1: digits and dots, at most 64 characters
_STUDY_UID, _SERIES_UID, _SOP_UID, _NUM_INSTANCES = "0020000D", "0020000E", "00080018", "00201209"
_NOT_SERVED = (404, 410)  # the store's answer about a series it listed: a reject


# A store's URLs hold UIDs (/studies/{uid}/series/{uid}) and, in their queries, the filters' values
# (a PatientID, a date): they are redacted from the errors this module raises and from the log records
# of the HTTP libraries (urllib3 logs each URL).
_URL_UIDS = re.compile(r"(/(?:studies|series|instances|frames)/)[^/?#\s'\"]+|([?&][^=&#\s'\"]+=)[^&#\s'\"]*")
_HTTP_LOGGERS = ("urllib3.connectionpool", "dicomweb_client", "dicomweb_client.web", "requests")


def redact(text: str) -> str:
  """`text` with the UIDs of store URLs' paths and the values of their queries replaced by {uid}."""
  return _URL_UIDS.sub(lambda m: f"{m[1] or m[2]}{{uid}}", text)


_DOTTED = re.compile(r"\b[0-9]+(?:\.[0-9]+){2,}\b")  # what dicomweb-client logs bare ('series of study "1.2.3"')


class _RedactUids(logging.Filter):
  """Redacts every dotted number (a UID, though an IP address too) of the HTTP libraries' log records."""

  def filter(self, record: logging.LogRecord) -> bool:
    record.msg, record.args = _DOTTED.sub("{uid}", redact(record.getMessage())), None
    return True


for _name in _HTTP_LOGGERS:
  if not any(isinstance(f, _RedactUids) for f in logging.getLogger(_name).filters):
    logging.getLogger(_name).addFilter(_RedactUids())


class TruncatedBody(ConnectionError):
  """A multipart body ended before its closing delimiter (a cut connection): transient."""


class MalformedBody(ValueError):
  """A WADO-RS answer that is not a multipart/related body of DICOM parts; str(e) names what is wrong."""


class NotServed(Exception):
  """The store listed a series but will not serve it (HTTP 404 or 410)."""


def is_store_url(location: str) -> bool:
  """Whether --input names a DICOMweb service (http:// or https://) rather than a folder."""
  return location.startswith(("http://", "https://"))


def store_name(url: str) -> str:
  """The data set name a store URL gives (the DICOM store's ID for the Healthcare API, else the
  URL's last path segment)."""
  parts = [p for p in urllib.parse.urlsplit(url).path.split("/") if p]
  if len(parts) >= 2 and parts[-1] == "dicomWeb" and "dicomStores" in parts:
    return parts[-2]
  return parts[-1] if parts else urllib.parse.urlsplit(url).hostname or "dicomweb"


@dataclasses.dataclass(frozen=True)
class Series:
  """One series of the store, as its listing found it: the real UIDs (never written anywhere) and how many
  instances the store says it holds (NumberOfSeriesRelatedInstances, or the instance search's count).
  After the header stage, `parts` is the digest of the instances its retrieval held (`parts_digest`),
  which the shard step's retrieval must hold again."""

  study: str
  series: str
  num_instances: int
  parts: str = ""


@dataclasses.dataclass(frozen=True)
class StoreConfig:
  """Where the store is, how to authenticate, what to list."""

  url: str  # the DICOMweb base URL, without a trailing slash
  auth: str = "none"  # none, google, basic or bearer (auto resolved by `store_config`)
  credentials: str = ""  # basic/bearer: a JSON file, local or gs://, read where the session is made
  study_filter: tuple[tuple[str, str], ...] = ()
  series_filter: tuple[tuple[str, str], ...] = ()
  page_size: int = DEFAULT_PAGE_SIZE

  def __post_init__(self):
    if self.auth not in AUTH_MODES[1:]:
      raise ValueError(f"auth must be one of {AUTH_MODES[1:]}, got {self.auth!r}")
    if self.page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {self.page_size}")


def parse_filter(text: str) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
  """--dicomweb_filter ('ModalitiesInStudy=CT&StudyDate=20260101-20260131') → (study search filters,
  series search filters); series-level attributes (Modality, SeriesInstanceUID, ...) filter the series.

  Raises:
    UsageError: not key=value pairs joined by &, a key the listing sets itself, or one that is not a
      DICOM keyword or an 8-digit tag.
  """
  if not text.strip():
    return (), ()
  try:
    pairs = urllib.parse.parse_qsl(text, keep_blank_values=False, strict_parsing=True)
  except ValueError:  # which piece, never its text: a filter holds values (a PatientID, a date)
    pieces = text.split("&")
    bad = next((i for i, p in enumerate(pieces, 1) if "=" not in p), None)
    where = f": piece {bad} of {len(pieces)} is not key=value" if bad else ""
    raise UsageError(f"--dicomweb_filter must be QIDO-RS query parameters joined by &, e.g. "
                     f"'ModalitiesInStudy=CT&StudyDate=20260101-20260131'{where}") from None
  study, series, seen = [], [], set()
  for key, value in pairs:
    if key.lower() in _RESERVED_KEYS:
      raise UsageError(f"--dicomweb_filter: {key} is set by the listing itself")
    tag = tag_for_keyword(key)
    if tag is None and not re.fullmatch(r"[0-9A-Fa-f]{8}", key):
      raise UsageError(f"--dicomweb_filter: {key!r} is neither a DICOM keyword nor an 8-digit tag")
    tag = f"{tag:08X}" if tag is not None else key.upper()
    if tag in seen:  # QIDO-RS takes one value per attribute (a list is one value: CT\\MR)
      raise UsageError(f"--dicomweb_filter: {key} is given twice")
    seen.add(tag)
    (series if tag in _SERIES_KEYS else study).append((key, value))
  return tuple(study), tuple(series)


def store_config(url: str, auth: str, credentials: str, filter_text: str, page_size: int) -> StoreConfig:
  """The store flags, checked (nothing is requested here: `Store.probe` does that).

  Raises:
    UsageError: a URL with a user or password, a query or fragment, an unknown auth mode, basic or bearer without
      --dicomweb_credentials (or credentials for another mode), or a bad filter.
  """
  parts = urllib.parse.urlsplit(url)
  if parts.username is not None or parts.password is not None:  # it would be in every path the output records
    raise UsageError("--input: a DICOMweb base URL carries no user or password (they would be written into "
                     "every path the output and its logs record): use --dicomweb_auth=basic with "
                     "--dicomweb_credentials")
  if parts.query or parts.fragment or not parts.hostname:
    raise UsageError(f"--input {url!r}: a DICOMweb base URL has a host and no query or fragment "
                     "(filters go in --dicomweb_filter)")
  if auth not in AUTH_MODES:
    raise UsageError(f"--dicomweb_auth must be one of {', '.join(AUTH_MODES)}, got {auth!r}")
  if auth == "auto":
    auth = "google" if parts.hostname == HEALTHCARE_HOST else "none"
  if auth in ("basic", "bearer") and not credentials:
    raise UsageError(f"--dicomweb_auth={auth} needs --dicomweb_credentials (a JSON file, local or gs://)")
  if credentials and auth not in ("basic", "bearer"):
    raise UsageError(f"--dicomweb_credentials is read only with --dicomweb_auth=basic or bearer, not {auth}")
  study, series = parse_filter(filter_text)
  return StoreConfig(url=url.rstrip("/"), auth=auth, credentials=credentials, study_filter=study,
                     series_filter=series, page_size=page_size)


def instance_path(url: str, salt: str, study: str, series: str, sop: str) -> str:
  """How an instance is named in rejects and plans: the store URL and the run's salted hashes."""
  return f"{series_path(url, salt, study, series)}/instances/{salted_hash(salt, 'sop', sop)}"


def series_path(url: str, salt: str, study: str, series: str) -> str:
  """`instance_path`'s series part; its last segment is the records' `series_id`."""
  return f"{url}/studies/{salted_hash(salt, 'study', study)}/series/{salted_hash(salt, 'series', study, series)}"


def part_path(series_prefix: str, index: int) -> str:
  """How a part whose SOP Instance UID cannot be read is named: by its place in the series' body."""
  return f"{series_prefix}/parts/{index}"


def parts_digest(paths) -> str:
  """A digest of the instance paths a retrieval held (`Series.parts`): two retrievals of a series that hold
  the same instances have the same digest."""
  return hashlib.blake2b("\n".join(sorted(paths)).encode(), digest_size=16).hexdigest()


def split_multipart(body: bytes | bytearray, content_type: str) -> list[tuple[str, memoryview]]:
  """A multipart/related body → (the part's media type, a view of its bytes) per part, in order.

  Raises:
    MalformedBody: not multipart/related, no boundary, or parts that do not follow the delimiters.
    TruncatedBody: the body ends before its closing delimiter.
  """
  header = email.message.Message()
  header["content-type"] = content_type
  boundary = header.get_param("boundary")
  if header.get_content_type() != "multipart/related" or not isinstance(boundary, str) or not boundary:
    raise MalformedBody(f"the answer is {header.get_content_type()}"
                        f"{'' if boundary else ' without a boundary'}, not multipart/related")
  delimiter = b"--" + boundary.encode("latin-1")
  view = memoryview(body)
  pos = body.find(delimiter)
  if pos < 0:
    raise (TruncatedBody if delimiter.startswith(body) else MalformedBody)("the body holds no part delimiter")
  pos += len(delimiter)
  parts = []
  while True:
    if body.startswith(b"--", pos):
      return parts
    if not body.startswith(b"\r\n", pos):
      if len(body) - pos < 2:
        raise TruncatedBody(f"the body ends after {len(parts)} parts, before its closing delimiter")
      raise MalformedBody(f"part {len(parts)}: its delimiter is not followed by a line break")
    headers_end = body.find(b"\r\n\r\n", pos)
    if headers_end < 0:
      raise TruncatedBody(f"the body ends in part {len(parts)}, before its closing delimiter")
    part_header = email.message.Message()
    for line in body[pos + 2:headers_end].split(b"\r\n"):
      name, _, value = line.decode("latin-1").partition(":")
      if name.strip():
        part_header[name.strip()] = value.strip()
    start = headers_end + 4
    # A part's Content-Length (Orthanc and the Healthcare API send it) says where its delimiter must be:
    # checked there, not searched for through the part's bytes.
    length = part_header.get("content-length", "").strip()
    end = start + int(length) if length.isdigit() else -1
    if end < 0 or body[end:end + len(delimiter) + 2] != b"\r\n" + delimiter:
      end = body.find(b"\r\n" + delimiter, start - 2)
    if end < 0:
      raise TruncatedBody(f"the body ends in part {len(parts)}, before its closing delimiter")
    media = part_header.get_content_type() if "content-type" in part_header else "application/dicom"
    parts.append((media, view[start:end]))
    pos = end + 2 + len(delimiter)


def _valid_uid(value) -> bool:
  return isinstance(value, str) and len(value) <= 64 and _UID.fullmatch(value) is not None


def _uid_of(result: Mapping, tag: str) -> str | None:
  """The UID a QIDO-RS result (DICOM JSON) holds for `tag`, or None when it holds none or a malformed one."""
  values = (result.get(tag) or {}).get("Value") or [None]
  return values[0] if _valid_uid(values[0]) else None


class Store:
  """The store as a worker reaches it; picklable (the session is made again after unpickling)."""

  def __init__(self, config: StoreConfig, read_policy: inputs.ReadPolicy):
    self.config = config
    self.read_policy = read_policy
    self._session: requests.Session | None = None
    self._client: DICOMwebClient | None = None

  def __getstate__(self):
    return {**self.__dict__, "_session": None, "_client": None}

  # ------------------------------------------------------------ the session

  def _credentials(self) -> dict:
    try:
      creds = json.loads(inputs.read_input(self.config.credentials, self.read_policy.retry_seconds, 1 << 20))
    except (inputs.Unreadable, OSError, ValueError) as e:
      raise UsageError(f"--dicomweb_credentials: cannot read a JSON object from it ({type(e).__name__})") from None
    want = ("username", "password") if self.config.auth == "basic" else ("token",)
    if not isinstance(creds, dict) or not all(isinstance(creds.get(k), str) and creds[k] for k in want):
      raise UsageError(f"--dicomweb_credentials must hold a JSON object with {' and '.join(want)}")
    return creds

  @property
  def session(self) -> requests.Session:
    if self._session is None:
      auth = self.config.auth
      if auth == "google":
        credentials, _ = google.auth.default(scopes=[HEALTHCARE_SCOPE])
        session = AuthorizedSession(credentials)
      elif auth == "basic":
        creds = self._credentials()
        session = session_utils.create_session_from_user_pass(creds["username"], creds["password"])
      else:
        session = session_utils.create_session()
        if auth == "bearer":
          session.headers["Authorization"] = f"Bearer {self._credentials()['token']}"
      self._session = session
    return self._session

  @property
  def client(self) -> DICOMwebClient:
    if self._client is None:
      self._client = DICOMwebClient(self.config.url, session=self.session, timeout=retry.ATTEMPT_TIMEOUT_S)
      self._client.set_http_retry_params(retry=False)  # one retry level: ours
    return self._client

  def _call(self, fn, what: str):
    """`fn()` under the run's retry policy; an HTTP error keeps its status for the classifier, and loses the
    URL's UIDs (and its chained causes, which quote them)."""

    def attempt(_):
      try:
        return fn()
      except requests.JSONDecodeError:  # a search answered with something else than JSON
        raise ValueError("the answer is not JSON") from None
      except requests.RequestException as e:
        raise type(e)(redact(str(e)), response=e.response) from None

    return self.read_policy.retry_policy.call(attempt, what)

  # ------------------------------------------------------------ QIDO-RS

  def _search(self, search, what: str, tag: str, **ids) -> Iterator[Mapping]:
    """Every result of a search, page by page until an empty page, each UID (`tag`) once: offset paging
    on a store that changes may repeat a result. A page that adds nothing new ends the search with an
    error: a store that ignores `offset` would otherwise be listed forever."""
    offset, seen = 0, set()
    while True:
      page = self._call(lambda: search(**ids, limit=self.config.page_size, offset=offset), f"{what} (offset {offset})")
      if not page:
        return
      new = 0
      for r in page:
        uid = _uid_of(r, tag)
        if uid is None or uid not in seen:
          seen.add(uid)
          new += uid is not None
          yield r
      if not new and any(_uid_of(r, tag) for r in page):
        raise RuntimeError(f"{what}: the store answered a page of results it had already sent (offset {offset}): "
                           "it does not page with offset; try a larger --dicomweb_page_size")
      offset += len(page)

  def probe(self) -> None:
    """One study search of one result, at launch: a store that is not there, or that refuses the
    credentials, is a usage error before anything runs.

    Raises:
      UsageError: HTTP 401, 403 or 404, or an answer that is not QIDO-RS JSON.
      TransientInputError: the store answered only transient errors until the deadline.
    """
    try:
      self._call(lambda: self.client.search_for_studies(limit=1, search_filters=dict(self.config.study_filter)),
                 f"searching {self.config.url}")
    except requests.HTTPError as e:
      status = e.response.status_code if e.response is not None else "?"
      hint = "check --dicomweb_auth and its credentials" if status in (401, 403) else "is it a DICOMweb base URL?"
      raise UsageError(f"--input {self.config.url}: the store answered HTTP {status} to a study search ({hint})"
                       ) from None
    except ValueError:  # not JSON
      raise UsageError(f"--input {self.config.url}: the answer to a study search is not QIDO-RS JSON "
                       "(is it a DICOMweb base URL?)") from None

  def studies(self) -> Iterator[str | None]:
    """The Study Instance UIDs the study search lists (None for a result without a valid one)."""
    for r in self._search(self.client.search_for_studies, f"searching the studies of {self.config.url}", _STUDY_UID,
                          fields=[_STUDY_UID], search_filters=dict(self.config.study_filter)):
      yield _uid_of(r, _STUDY_UID)

  def series_of(self, study: str) -> Iterator[Series | None]:
    """The series of a study, each with its instance count (None for a result without a valid UID). The
    count is the search's NumberOfSeriesRelatedInstances (0020,1209), which a store answers from its index;
    for a store that leaves it out, the instance search's count (paged: slower, one result per instance)."""
    for r in self._search(self.client.search_for_series, "searching the series of a study", _SERIES_UID,
                          study_instance_uid=study, fields=[_SERIES_UID, _NUM_INSTANCES],
                          search_filters=dict(self.config.series_filter)):
      series = _uid_of(r, _SERIES_UID)
      if series is None:
        yield None
        continue
      count = ((r.get(_NUM_INSTANCES) or {}).get("Value") or [None])[0]
      if isinstance(count, str) and count.strip().isdigit():  # IS as a string: some stores send it so
        count = int(count)
      if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        count = sum(1 for _ in self._search(
            self.client.search_for_instances, "searching the instances of a series", _SOP_UID,
            study_instance_uid=study, series_instance_uid=series, fields=[_SOP_UID]))
      yield Series(study, series, count)

  # ------------------------------------------------------------ WADO-RS

  def retrieve(self, s: Series) -> list[tuple[str, memoryview]]:
    """The series' instances as stored: (media type, a view of its bytes) per part of the WADO-RS answer.

    Raises:
      NotServed: HTTP 404 or 410 (the store lists the series but does not serve it).
      MalformedBody: an answer that is not multipart/related (or is larger than its instances may be).
      TransientInputError: transient errors (a cut body included) until the deadline.
      requests.HTTPError: any other refusal (401, 403, ...): the run fails.
    """
    url = f"{self.config.url}/studies/{s.study}/series/{s.series}"
    limit = self.read_policy.max_bytes * max(1, s.num_instances)

    def attempt():
      with self.session.get(url, headers={"Accept": SERIES_ACCEPT}, stream=True,
                            timeout=retry.ATTEMPT_TIMEOUT_S) as r:
        if r.status_code in _NOT_SERVED:
          raise NotServed(f"HTTP {r.status_code}")
        r.raise_for_status()
        length = r.headers.get("Content-Length", "")
        if length.isdigit() and int(length) > limit:
          raise MalformedBody(f"the answer is larger than {s.num_instances} instances of --max_input_bytes")
        # Into one buffer of the announced size (a series is held once, its parts are views of it).
        body, size = bytearray(int(length) if length.isdigit() else 0), 0
        for chunk in r.iter_content(4 << 20):
          if size + len(chunk) > limit:
            raise MalformedBody(f"the answer is larger than {s.num_instances} instances of --max_input_bytes")
          body[size:size + len(chunk)] = chunk
          size += len(chunk)
        if size < len(body):  # shorter than announced (urllib3 raises first; kept as a guard)
          raise TruncatedBody(f"the body ended after {size} of {len(body)} bytes")
        return split_multipart(body, r.headers.get("Content-Type", ""))

    return self._call(attempt, "retrieving a series")
