"""A simulated kubelet: runs the containers of pods as local processes.

Run it as ``python -m tests.cluster.sim_kubelet --kubeconfig PATH --workdir DIR --runner-python PYTHON
[--restart-backoff-scale F]``. It is an ordinary API client (watches and patches over HTTP), so it works against
any API server; the local test cluster starts it next to a real kube-apiserver, which has no scheduler, kubelet or
controller-manager of its own.

What it does
------------
* Registers the Node ``sim-node-0`` (``InternalIP 127.0.0.1``; ``daemonEndpoints.kubeletEndpoint.Port`` = the port
  of its own HTTPS server), so that ``pods/log`` requests through the real apiserver are proxied to it, as the
  apiserver does for a real kubelet.
* Binds every unbound pod to that node through the ``pods/binding`` subresource (what a scheduler does), then runs
  each container's ``command`` + ``args`` as a local subprocess in its own process group. Every process group id
  is appended to ``<workdir>/pgids`` so that the control plane's ``down`` can kill leftovers.
* Runs every container as if from the runner image (``docker/Dockerfile``), whatever its ``image`` says:
  ``python``/``python3``/``python3.X`` run with ``--runner-python``, and ``torchrun`` as ``<that python> -m
  torch.distributed.run``. That interpreter is the runner env (``scripts/build-runner-env.sh``: torch,
  cloudpickle, numpy and this package installed ``--no-deps``; no Airflow, no kubernetes client, no checkout on its
  path), so a pod can use only what travels in its payload, as on a real cluster.
* The process gets only what a container gets on a real node, nothing of this process's environment: the image's
  ENV (``PATH`` with the runner env's bin first, ``PYTHONUNBUFFERED=1``, ``LANG``, ``HOME``), ``HOSTNAME`` = the
  pod's hostname (``spec.hostname``, else the pod name), ``KUBERNETES_SERVICE_HOST``/``KUBERNETES_SERVICE_PORT``
  (the API server this kubelet talks to), and the manifest's ``env``/``envFrom`` with downward API values, which
  win over all of these. Its working directory is
  the container's ``workingDir``: a directory of the container's own (paths under it are rewritten like mount
  paths, see below) unless it lies on a volume; with no ``workingDir``, an empty directory of the container's own.
  That directory and ``HOME`` start empty for every container instance, as a new container's writable layer does.
  So does ``TMPDIR``, a directory of the container's own: it stands in for the container's own ``/tmp``, which a
  process here would otherwise share with the host (and leave files in when its pod is killed).
* Reports ``pods/status`` in the full shape a real kubelet writes (phase, conditions, IPs, container and init
  container statuses with imageID/containerID/restartCount/state/lastState, termination messages).
* Restarts containers in place under ``restartPolicy`` OnFailure/Always (init containers: unless Never) with the
  real kubelet's crash-loop backoff (kubernetes ``pkg/kubelet/kubelet.go`` ``backOffPeriod`` 10 s and
  ``MaxContainerBackOff`` 300 s, client-go ``flowcontrol.Backoff``, one entry per container of a pod UID): the
  first exit restarts at once; each later exit waits 10, 20, 40, 80, 160, then 300 s, in state waiting
  ``CrashLoopBackOff`` with message ``back-off 1m20s restarting failed container=<c> pod=<pod>_<ns>(<uid>)`` and a
  ``BackOff`` event; an exit more than 10 min (2 x the cap) after the container's last restart starts over (at once,
  then 10 s). ``restartCount`` counts the restarts done, so it goes up when the new instance starts. Under Never a
  terminated container stays terminated.

  ``--restart-backoff-scale F`` (default 1, the real timing) is a **test-only speed-up**: it multiplies every wait
  and the 10-minute reset window by F. The test cluster (``control_plane``) passes 0.1, so crash loops wait 1, 2, 4,
  8, 16, then 30 s, and a test that makes a pod crash a few times takes seconds instead of minutes (at scale 1 the
  fourth restart alone would wait 40 s). The messages keep the real, unscaled window in Go's duration format
  (``10s``, ``1m20s``, ``5m0s``), so what a client reads is exactly what a real node writes; only the clock is
  faster.
* On pod deletion: SIGTERM to each process group, SIGKILL after the grace period (capped at 10 s), then removes the
  object (``gracePeriodSeconds=0`` with a UID precondition). There is no garbage collector in the test cluster, so
  the GC's ``foregroundDeletion``/``orphan`` finalizers on a pod (which has no dependents) are removed here.
* Serves ``GET /containerLogs/{ns}/{pod}/{container}`` with ``follow``, ``previous``, ``tailLines``,
  ``timestamps``, ``sinceSeconds``, ``sinceTime`` and ``limitBytes``.

Filesystem layout under ``--workdir``
-------------------------------------
``<ns>/<pod>/volumes/<volume>``             ConfigMap, Secret, downwardAPI, projected and emptyDir volumes.
``<ns>/<pod>/termination/<container>``      the container's terminationMessagePath.
``<ns>/<pod>/containers/<container>/``      the container's own files: ``workdir`` (its working dir unless that is
                                            on a volume), ``home`` (HOME) and ``tmp`` (TMPDIR); emptied at each
                                            container start.
``<ns>/<pod>/logs/<container>/<n>.log``     log of the n-th run (restartCount n): ``<RFC3339Nano> <line>``.
``pgids``                                   one process group id per line.

Paths inside a container are not real: every command/args/env value that equals or starts with a ``mountPath``
(or with the ``terminationMessagePath``, or with a ``workingDir`` that is not on a volume) is rewritten to the
materialized host path, also after ``--flag=`` and in ``:``-separated env lists. Programs must therefore receive
such paths through env, command or args (or use paths relative to the working directory), not as constants compiled
into the code.

Networking
----------
All pods share this machine's loopback, so every pod and Service name resolves to ``127.0.0.1`` (and so does
``<hostname>.<subdomain>`` of a pod with ``spec.hostname``/``spec.subdomain`` that a headless Service named as the
subdomain selects, as JobSet's pods; the name then stands for that pod, for the port map too) and every
declared ``containerPort`` of a pod (or Service port) gets its own free host port, allocated on first sight and
shared by all pods (key: namespace, pod-or-service name, port). Env values are rewritten: ``<host>:<port>`` (also
inside URLs and ``host.ns.svc[.cluster.local]`` forms) where ``host`` is a pod or Service of the cluster becomes
``127.0.0.1:<mapped>``; a value that is exactly such a host becomes ``127.0.0.1``; ``MASTER_PORT`` and
``PET_MASTER_PORT`` become the mapped port of ``MASTER_ADDR``/``PET_MASTER_ADDR``. The same ``host:port`` rewrite
applies to command and args. A c10d rendezvous on ``PET_RDZV_ENDPOINT`` then works across pods.

**Only the endpoint's host can host the c10d store.** On a real cluster ``PET_RDZV_ENDPOINT=<job>-worker-0:23456``
resolves to worker-0's pod IP, and torch's c10d backend (``_create_tcp_store``: ``is_host`` unset ->
``_matches_machine_hostname(host)``) hosts the TCPStore only on the machine whose name or address that is; every
other agent connects as a client, and fails after ``read_timeout`` (60 s) when nobody serves the store. Here the
endpoint is a loopback address, which matches every pod, so any agent could host it. Hence, for a container whose
endpoint (``--rdzv-endpoint``/``--rdzv_endpoint`` in command/args, else ``PET_RDZV_ENDPOINT``) names a pod or
Service of the cluster, the kubelet adds ``is_host=1`` to the rendezvous config of the pod that is that host (the
pod of that name, or one a headless Service of that name selects) and ``is_host=0`` to every other pod's; nothing
is added when the config already has an ``is_host`` (a user's choice wins, as on a real cluster). It goes where the
config is read from: the last ``--rdzv-conf``/``--rdzv_conf`` argument if there is one (the command line wins over
the env; the provider's runner passes ``--rdzv-conf timeout=...``), else ``PET_RDZV_CONF`` (appended with ``,``, or
created). ``1``/``0`` work both for torchrun (``RendezvousParameters.get_as_bool`` accepts the strings) and for the
provider's runner (``_parse_rdzv_conf`` makes ints of them, which ``get_as_bool`` accepts too). So a worker-1 whose
worker-0 never starts waits as a client and then fails with ``The connection to the C10d store has failed``,
instead of hosting the store itself; and no pod hosts behind a ClusterIP Service, as on a real cluster.

The PyTorchJob ``init-pytorch`` init container (``nslookup <job>-master-0`` in a loop) is not run as a process: it
succeeds once the named pod is Running, which is when a real cluster DNS would answer for its headless Service.

Failure injection (pod annotations; a PyTorchJob replica template's annotations land on every pod of that type)
------------------------------------------------------------------------------------------------------------------
``sim.torchelastic.dev/fail``:
    ``ImagePullBackOff``  the pod stays Pending; containers waiting ``ErrImagePull`` for ~1 s, then
                          ``ImagePullBackOff`` (``Back-off pulling image "<image>"``).
    ``ErrImagePull``      as above but stays ``ErrImagePull``.
    ``Unschedulable``     the pod is never bound; Pending with condition PodScheduled=False, reason Unschedulable,
                          message ``0/1 nodes are available: 1 Insufficient nvidia.com/gpu.`` (what the 1.20
                          scheduler writes when no node has the GPUs a pod requests) and a Warning
                          ``FailedScheduling`` event from ``default-scheduler``. This is the test-only stand-in for
                          an unsatisfiable scheduling constraint; with ``fail-indexes`` (below) it hits only some
                          replicas, e.g. ``fail-indexes: "0"`` on a Worker template keeps only ``<job>-worker-0``
                          from ever being scheduled.
    ``CreateContainerConfigError``  Pending; containers waiting ``CreateContainerConfigError``.
    ``OOMKilled``         the container runs, then after ``fail-after-seconds`` (default 1) the kernel's OOM
                          killer is played as ``oom-kills`` says, and the container terminates with reason
                          ``OOMKilled`` (containerd's, kept whatever the exit code) and its exit code.
``sim.torchelastic.dev/fail-after-seconds``: delay for ``OOMKilled`` (float).
``sim.torchelastic.dev/fail-after-log-line``: with ``OOMKilled``, the delay counts from the first line of the
    container's output that contains this text, not from its start: the kill then lands at a known point of the
    program (e.g. once its process group is up) on a fast machine and a slow one alike.
``sim.torchelastic.dev/oom-kills``: which processes an ``OOMKilled`` fault kills (issue 33, item 2).
    ``worker`` (the default): one process, as the kernel does on cgroup v1 (and on v2 before kubelet 1.28): the
    largest (RSS) descendant of the container's main process, a worker of the runner, whose agent lives on to report
    that rank's SIGKILL and exits with its own code; the main process itself when it has no descendant yet (the
    kernel has only it to pick). ``whole-container``: the whole process group, as cgroup v2's
    ``memory.oom.group`` does where kubelet >= 1.28 sets it: exit code 137 and no runner report.
``sim.torchelastic.dev/fail-container``: comma-separated container names the fault applies to (default: all
    app containers; init containers are never faulted).
``sim.torchelastic.dev/evict-after-seconds=N``: N s after the containers start, the pod is evicted: processes get
    SIGTERM (SIGKILL after the grace period), phase Failed, reason ``Evicted``, message like a real node-pressure
    eviction, condition ``DisruptionTarget``; evicted pods are never restarted.
``sim.torchelastic.dev/start-delay-seconds=N``: the pod stays Pending (ContainerCreating) for N s first.
``sim.torchelastic.dev/hold=true``: the app containers start no process: they are Running (with an empty log) until
    the pod gets the annotation ``sim.torchelastic.dev/exit-code=N``, then terminate with exit code N. For load tests
    (hundreds of running pods at no CPU cost) and for tests that decide when a pod ends.
``sim.torchelastic.dev/fail-times=N``: inject ``fail``/``evict-after-seconds`` only the first N times for this
    namespace/pod name (each container start for OOMKilled, each pod otherwise). A recreated pod keeps its name, so
    this gives "fails once, then succeeds after the operator's restart".
``sim.torchelastic.dev/fail-times-scope=<label key>``: count ``fail-times`` per value of that pod label (and per
    ``training.kubeflow.org/replica-type``/``replica-index``) instead of per pod name, so that a *new* job, whose pods
    have new names, shares the count: with ``torchelastic.airflow.apache.org/run-id`` a replica fails on the first
    try of a DAG run and not on its retry (a retry submits a new PyTorchJob).
``sim.torchelastic.dev/fail-indexes="1,3"``: aim the pod's faults at some replicas of its type: every annotation
    above (``fail``, ``evict-after-seconds``, ``start-delay-seconds`` and their modifiers) applies only to pods
    whose label ``training.kubeflow.org/replica-index`` is listed; the others of the same replica template run
    without faults. A pod without that label (a bare Pod) is never targeted. Entries that are not ints are ignored.

RBAC this identity needs: pods get/list/watch/patch/delete, pods/status patch, pods/binding create, nodes
create/patch, nodes/status patch, configmaps/secrets/services get, events create.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import functools
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from tests.cluster.watch import ListWatch

log = logging.getLogger("sim-kubelet")

NODE_NAME = "sim-node-0"
HOST_IP = "127.0.0.1"

ANN_FAIL = "sim.torchelastic.dev/fail"
ANN_FAIL_AFTER = "sim.torchelastic.dev/fail-after-seconds"
ANN_FAIL_AFTER_LOG_LINE = "sim.torchelastic.dev/fail-after-log-line"
ANN_FAIL_CONTAINER = "sim.torchelastic.dev/fail-container"
ANN_FAIL_TIMES = "sim.torchelastic.dev/fail-times"
ANN_EVICT_AFTER = "sim.torchelastic.dev/evict-after-seconds"
ANN_START_DELAY = "sim.torchelastic.dev/start-delay-seconds"
ANN_FAIL_INDEXES = "sim.torchelastic.dev/fail-indexes"
ANN_FAIL_TIMES_SCOPE = "sim.torchelastic.dev/fail-times-scope"
ANN_OOM_KILLS = "sim.torchelastic.dev/oom-kills"
#: What an ``OOMKilled`` fault kills: one worker (cgroup v1's kernel) or the whole container (cgroup v2's group kill).
OOM_KILLS = ("worker", "whole-container")
ANN_HOLD = "sim.torchelastic.dev/hold"
ANN_EXIT_CODE = "sim.torchelastic.dev/exit-code"
FAULTS = ("ImagePullBackOff", "ErrImagePull", "Unschedulable", "CreateContainerConfigError", "OOMKilled")
# What the training operator puts on every pod of a PyTorchJob (``replica_labels`` in sim_operator).
LABEL_REPLICA_TYPE = "training.kubeflow.org/replica-type"
LABEL_REPLICA_INDEX = "training.kubeflow.org/replica-index"

DEFAULT_TERMINATION_PATH = "/dev/termination-log"
MAX_TERMINATION_MESSAGE = 4096
FALLBACK_LOG_LINES = 80
FALLBACK_LOG_BYTES = 2048
MAX_GRACE_SECONDS = 10.0
#: The real kubelet's crash-loop backoff (kubernetes pkg/kubelet/kubelet.go ``backOffPeriod`` and
#: ``MaxContainerBackOff``), in seconds; ``--restart-backoff-scale`` shortens the waits for tests.
RESTART_BACKOFF_START = 10.0
RESTART_BACKOFF_MAX = 300.0
#: What the control plane passes as ``--restart-backoff-scale``: crash-loop windows of 1, 2, 4, ... 30 s.
TEST_RESTART_BACKOFF_SCALE = 0.1
INIT_PYTORCH_TRIES = 100
INIT_PYTORCH_SLEEP = 2.0
# The GC's finalizers: a pod has no dependents, so the GC would remove them at once; none runs in this cluster.
GC_FINALIZERS = frozenset({"foregroundDeletion", "orphan"})
# Host ports handed to containers come from below the Linux ephemeral range (32768+), so they never collide with
# the source ports of outgoing connections.
PORT_RANGE = (20000, 32000)
PATCH_MERGE = "application/merge-patch+json"


# ----------------------------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------------------------


def now_rfc3339() -> str:
    """A Kubernetes metav1.Time (second precision, UTC)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def log_timestamp() -> str:
    """The CRI log timestamp (RFC3339Nano), as ``timestamps=true`` returns it."""
    ns = time.time_ns()
    secs, frac = divmod(ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs)) + f".{frac:09d}Z"


def parse_timestamp(value: str) -> float:
    """Seconds since the epoch of an RFC3339 timestamp with up to nanosecond precision."""
    value = value.strip()
    if value.endswith("Z"):
        value = value[:-1] + "+00:00"
    main, _, rest = value.partition(".")
    if rest:
        digits = re.match(r"\d*", rest)
        assert digits is not None
        frac = digits.group(0)
        tz = rest[len(frac) :]
        value = f"{main}.{frac[:6].ljust(6, '0')}{tz}"
    return dt.datetime.fromisoformat(value).timestamp()


def exit_code_of(returncode: int) -> int:
    """A container runtime reports death by signal N as 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def largest_descendant(pid: int) -> int | None:
    """The descendant of ``pid`` with the largest resident set, the kernel OOM killer's pick when nothing else differs
    (its badness is mostly RSS); None when it has none (or is gone)."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return None
    sizes = {}
    for child in children:
        with contextlib.suppress(psutil.Error):
            sizes[child.pid] = child.memory_info().rss
    return max(sizes, key=lambda p: sizes[p]) if sizes else None


def random_hex64() -> str:
    return os.urandom(32).hex()


def image_id_of(image: str) -> str:
    """A stable, realistic imageID: the kubelet reports what the runtime resolved the tag to."""
    digest = hashlib.sha256(image.encode()).hexdigest()
    return f"docker-pullable://{image.split('@')[0]}@sha256:{digest}"


def parse_float(value: str | None, default: float | None = None) -> float | None:
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        log.warning("ignoring non-numeric annotation value %r", value)
        return default


def parse_indexes(value: str) -> frozenset[int]:
    """``"1, 3"`` -> {1, 3}; entries that are not non-negative ints are ignored with a warning."""
    indexes: set[int] = set()
    for item in value.split(","):
        item = item.strip()
        if item.isdigit():
            indexes.add(int(item))
        elif item:
            log.warning("ignoring %s entry %r (expected a replica index)", ANN_FAIL_INDEXES, item)
    return frozenset(indexes)


def faults_target(meta: dict[str, Any]) -> bool:
    """Whether this pod's injected faults apply to it: always, unless ``fail-indexes`` lists replica indexes and the
    pod's ``training.kubeflow.org/replica-index`` label is not among them (a pod without that label never is)."""
    wanted = (meta.get("annotations") or {}).get(ANN_FAIL_INDEXES)
    if wanted is None:
        return True
    index = (meta.get("labels") or {}).get(LABEL_REPLICA_INDEX, "")
    return index.isdigit() and int(index) in parse_indexes(wanted)


def fault_budget_key(meta: dict[str, Any], kind: str) -> tuple[str, ...]:
    """What ``fail-times`` counts per: the pod name; with ``fail-times-scope: <label key>``, that label's value and
    the replica type and index, so that the pods of a new job (new names) share the count with the old job's."""
    scope = (meta.get("annotations") or {}).get(ANN_FAIL_TIMES_SCOPE)
    if not scope:
        return (meta["namespace"], "pod", meta["name"], kind)
    labels = meta.get("labels") or {}
    return (
        meta["namespace"],
        "scope",
        scope,
        labels.get(scope, ""),
        labels.get(LABEL_REPLICA_TYPE, ""),
        labels.get(LABEL_REPLICA_INDEX, ""),
        kind,
    )


# ----------------------------------------------------------------------------------------------------------------
# Pure rules: variable expansion, path and host rewriting, phases, statuses
# ----------------------------------------------------------------------------------------------------------------


def expand_vars(value: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: ``$$`` escapes ``$``; unknown references stay as they are."""
    out: list[str] = []
    i, n = 0, len(value)
    while i < n:
        ch = value[i]
        if ch == "$" and i + 1 < n:
            nxt = value[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = value.find(")", i + 2)
                if end != -1:
                    name = value[i + 2 : end]
                    out.append(env[name] if name in env else value[i : end + 1])
                    i = end + 1
                    continue
        out.append(ch)
        i += 1
    return "".join(out)


def rewrite_path(value: str, mounts: list[tuple[str, str]]) -> str:
    """Map a container path to its host path; ``mounts`` is (container path, host path), longest first."""
    for mount_path, host_path in mounts:
        base = mount_path.rstrip("/") or "/"
        if value in (mount_path, base):
            return host_path
        if base != "/" and value.startswith(base + "/"):
            return host_path + value[len(base) :]
    return value


def is_under_mount(value: str, mounts: list[tuple[str, str]]) -> bool:
    """Whether the container path ``value`` lies on one of the ``mounts``."""
    for mount_path, _ in mounts:
        base = mount_path.rstrip("/") or "/"
        if value in (mount_path, base) or base == "/" or value.startswith(base + "/"):
            return True
    return False


def rewrite_path_value(value: str, mounts: list[tuple[str, str]], split_colons: bool) -> str:
    """Rewrite a whole value, the part after ``--flag=``, or (for env) each part of a ``a:b`` path list."""
    rewritten = rewrite_path(value, mounts)
    if rewritten != value:
        return rewritten
    flag, eq, rest = value.partition("=")
    if eq and flag.startswith("-") and rest.startswith("/"):
        return f"{flag}={rewrite_path(rest, mounts)}"
    if split_colons and ":" in value and all(p.startswith("/") for p in value.split(":") if p):
        return ":".join(rewrite_path(p, mounts) if p else p for p in value.split(":"))
    return value


ENV_NAME_RE = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
# Env variables whose whole value may be a bare host name (MASTER_ADDR, PET_MASTER_ADDR, RDZV_HOST, ...).
BARE_HOST_VAR_RE = re.compile(r"(ADDR|HOST|HOSTNAME)$")
# Service names are DNS-1035 labels (a letter first); this also keeps values like PET_NNODES="2:2" out.
HOST_PORT_RE = re.compile(r"(?<![\w.-])([a-z](?:[-a-z0-9.]*[a-z0-9])?):(\d{1,5})(?!\d)")


def rewrite_hosts(
    value: str,
    resolve: Callable[[str], tuple[str, str] | None],
    map_port: Callable[[str, str, int], int],
    bare: bool,
) -> str:
    """Rewrite ``host:port`` occurrences whose host is a cluster pod/Service to the mapped loopback port; with
    ``bare``, a value that is exactly such a host becomes 127.0.0.1.

    ``resolve(host)`` returns (namespace, object name) for a cluster name or None.
    """
    if bare and resolve(value) is not None:
        return HOST_IP
    if ":" not in value:
        return value

    def sub(match: re.Match[str]) -> str:
        target = resolve(match.group(1))
        if target is None:
            return match.group(0)
        return f"{HOST_IP}:{map_port(target[0], target[1], int(match.group(2)))}"

    return HOST_PORT_RE.sub(sub, value)


def split_cluster_host(host: str, namespace: str) -> tuple[str, str] | None:
    """(namespace, name) of a DNS name of the form name, name.ns, name.ns.svc, name.ns.svc.cluster.local."""
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", host):
        return None
    parts = host.split(".")
    if len(parts) == 1:
        return namespace, parts[0]
    if parts[-2:] == ["cluster", "local"]:
        parts = parts[:-2]
    if parts[-1:] == ["svc"]:
        parts = parts[:-1]
    if len(parts) == 2:
        return parts[1], parts[0]
    return None


def split_pod_hostname(host: str, namespace: str) -> tuple[str, str, str] | None:
    """(namespace, hostname, subdomain) of a pod DNS name ``hostname.subdomain[.ns[.svc[.cluster.local]]]``.

    A pod with ``spec.hostname`` and ``spec.subdomain`` gets that name when a headless Service named as the subdomain
    selects it (what JobSet's pods use: ``<job>-<index>.<jobset>``). The search path tries this form first, before
    ``name.ns`` (``a.b`` is looked up as ``a.b.<ns>.svc.cluster.local`` before ``a.b.svc.cluster.local``).
    """
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", host):
        return None
    parts = host.split(".")
    if parts[-2:] == ["cluster", "local"]:
        parts = parts[:-2]
        if parts[-1:] != ["svc"]:
            return None
    if parts[-1:] == ["svc"]:
        parts = parts[:-1]
        if len(parts) != 3:
            return None
    if len(parts) == 2:
        return namespace, parts[0], parts[1]
    if len(parts) == 3:
        return parts[2], parts[0], parts[1]
    return None


def pod_dns_hostname(pod: dict[str, Any]) -> str:
    """The pod's hostname, as the kubelet gives it (``GeneratePodHostNameAndDomain``): ``spec.hostname``, else the
    pod name cut to 63 characters (without a trailing ``-``/``.``)."""
    spec = pod.get("spec") or {}
    return str(spec.get("hostname") or pod["metadata"]["name"][:63].rstrip("-."))


RDZV_ENDPOINT_FLAGS = ("--rdzv-endpoint", "--rdzv_endpoint")
RDZV_CONF_FLAGS = ("--rdzv-conf", "--rdzv_conf")


def flag_value(argv: list[str], flags: tuple[str, ...]) -> tuple[int, str] | None:
    """(argv index, value) of the last ``--flag VALUE`` or ``--flag=VALUE`` (argparse keeps the last one)."""
    found: tuple[int, str] | None = None
    for i, item in enumerate(argv):
        for flag in flags:
            if item == flag and i + 1 < len(argv):
                found = (i + 1, argv[i + 1])
            elif item.startswith(flag + "="):
                found = (i, item[len(flag) + 1 :])
    return found


def endpoint_host(endpoint: str) -> str:
    """``host:port`` or ``host`` -> host (torch's ``parse_rendezvous_endpoint``; an IPv6 ``[addr]:port`` too)."""
    endpoint = endpoint.strip()
    if endpoint.startswith("["):
        return endpoint[1:].partition("]")[0]
    host, sep, port = endpoint.rpartition(":")
    return host if sep and port.isdigit() else endpoint


def conf_with_is_host(conf: str, is_host: bool) -> str:
    """Append ``is_host=1|0`` to a ``k=v,k=v`` rendezvous config unless it already says (the user's choice wins).

    ``1``/``0``: torchrun keeps the string, which ``RendezvousParameters.get_as_bool`` accepts; the runner's
    ``_parse_rdzv_conf`` makes an int of it, which ``get_as_bool`` accepts as well (``true`` would also do for both).
    """
    keys = {item.partition("=")[0].strip() for item in conf.split(",")}
    if "is_host" in keys:
        return conf
    item = f"is_host={int(is_host)}"
    return f"{conf},{item}" if conf.strip() else item


def rdzv_endpoint(argv: list[str], env: dict[str, str]) -> str | None:
    """The c10d endpoint a torchrun-style program uses: ``--rdzv-endpoint`` (or ``--rdzv_endpoint``) when given,
    else ``PET_RDZV_ENDPOINT``; None when neither is set."""
    given = flag_value(argv, RDZV_ENDPOINT_FLAGS)
    endpoint = given[1] if given is not None else env.get("PET_RDZV_ENDPOINT", "")
    return endpoint.strip() or None


def with_is_host(argv: list[str], env: dict[str, str], is_host: bool) -> tuple[list[str], dict[str, str]]:
    """Say ``is_host`` where the rendezvous config is read from: the last ``--rdzv-conf``/``--rdzv_conf`` argument
    if there is one (a command line wins over the env), else ``PET_RDZV_CONF`` (created if missing)."""
    conf = flag_value(argv, RDZV_CONF_FLAGS)
    if conf is None:
        return argv, {**env, "PET_RDZV_CONF": conf_with_is_host(env.get("PET_RDZV_CONF", ""), is_host)}
    index, value = conf
    argv = list(argv)
    prefix = argv[index][: len(argv[index]) - len(value)]  # "--rdzv-conf=" or "" (the value is its own item)
    argv[index] = prefix + conf_with_is_host(value, is_host)
    return argv, env


def python_argv(argv: list[str], python: str) -> list[str]:
    """Run container Pythons with the runner env's interpreter ``python``; ``torchrun`` becomes ``python -m
    torch.distributed.run`` (the runner env's own ``torchrun`` script does the same for a shell's PATH lookup)."""
    if not argv:
        return argv
    exe = os.path.basename(argv[0])
    if re.fullmatch(r"python(3(\.\d+)?)?", exe):
        return [python, *argv[1:]]
    if exe == "torchrun":
        return [python, "-m", "torch.distributed.run", *argv[1:]]
    return argv


#: What ``python:3.11-slim`` puts on PATH after the runner env's bin.
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def image_env(runner_python: str, home: str) -> dict[str, str]:
    """The runner image's own ENV (docker/Dockerfile on python:slim), with its bin on PATH as the image has it.

    HOME is what the runtime sets for the image's user; here a directory of the container's own.
    """
    return {
        "PATH": f"{os.path.dirname(runner_python)}:{IMAGE_PATH}",
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "HOME": home,
    }


def service_env(api_host: str, api_port: int) -> dict[str, str]:
    """The ``kubernetes`` Service's variables, which a kubelet gives every container: the API server's address as
    the cluster knows it (all pods share this machine's loopback, so the real address)."""
    return {"KUBERNETES_SERVICE_HOST": api_host, "KUBERNETES_SERVICE_PORT": str(api_port)}


@dataclass(frozen=True)
class ProcessConfig:
    """How to start one container instance as a process."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    #: The container's own directory (its working dir unless that is on a volume, HOME and TMPDIR): fresh for every
    #: instance, as a container's writable layer is.
    container_dir: Path
    home: Path
    tmp: Path
    #: Host file behind terminationMessagePath.
    term_path: Path


def qos_class(pod: dict[str, Any]) -> str:
    """The pod's QoS class by the kubelet's rules (requests default to limits)."""
    containers = list(pod["spec"].get("initContainers") or []) + list(pod["spec"].get("containers") or [])
    any_set = False
    guaranteed = True
    for c in containers:
        res = c.get("resources") or {}
        limits = res.get("limits") or {}
        requests = {**limits, **(res.get("requests") or {})}
        if limits or requests:
            any_set = True
        for name in ("cpu", "memory"):
            if name not in limits or requests.get(name) != limits.get(name):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


@dataclass
class ContainerView:
    """What the status builder needs to know about one container."""

    name: str
    image: str
    state: dict[str, Any]
    last_state: dict[str, Any]
    ready: bool
    started: bool
    restart_count: int
    container_id: str


@dataclass
class PodView:
    """The kubelet's view of one pod, from which its status is built."""

    scheduled: bool
    phase: str
    unschedulable_message: str | None = None
    reason: str | None = None
    message: str | None = None
    sandbox_ready: bool = False
    start_time: str | None = None
    init: list[ContainerView] = field(default_factory=list)
    main: list[ContainerView] = field(default_factory=list)
    disruption_message: str | None = None


def container_status(view: ContainerView) -> dict[str, Any]:
    status: dict[str, Any] = {
        "name": view.name,
        "image": view.image,
        "imageID": image_id_of(view.image) if view.container_id else "",
        "ready": view.ready,
        "restartCount": view.restart_count,
        "started": view.started,
        "state": view.state,
        "lastState": view.last_state,
    }
    if view.container_id:
        status["containerID"] = view.container_id
    return status


def _condition(ctype: str, ok: bool, reason: str | None = None, message: str | None = None) -> dict[str, Any]:
    cond: dict[str, Any] = {"type": ctype, "status": "True" if ok else "False", "lastProbeTime": None}
    if reason:
        cond["reason"] = reason
    if message:
        cond["message"] = message
    return cond


def pod_conditions(view: PodView) -> list[dict[str, Any]]:
    """Pod conditions in the order a real kubelet writes them (lastTransitionTime is stamped by the caller)."""
    if not view.scheduled:
        return [_condition("PodScheduled", False, "Unschedulable", view.unschedulable_message)]
    finished = view.phase in ("Succeeded", "Failed")
    not_init = [c.name for c in view.init if not ("terminated" in c.state and c.state["terminated"]["exitCode"] == 0)]
    if finished and view.phase == "Succeeded":
        not_init = []
    unready = [c.name for c in view.main if not c.ready]
    conds: list[dict[str, Any]] = []
    if view.disruption_message:
        conds.append(_condition("DisruptionTarget", True, "TerminationByKubelet", view.disruption_message))
    if not_init:
        conds.append(
            _condition(
                "Initialized",
                False,
                "ContainersNotInitialized",
                f"containers with incomplete status: [{' '.join(not_init)}]",
            )
        )
    else:
        conds.append(_condition("Initialized", True))
    ready_cond: tuple[str, str | None]
    if finished:
        ready_cond = ("PodCompleted", None)
    else:
        ready_cond = ("ContainersNotReady", f"containers with unready status: [{' '.join(unready)}]")
    if unready or finished:
        conds.append(_condition("Ready", False, *ready_cond))
        conds.append(_condition("ContainersReady", False, *ready_cond))
    else:
        conds.append(_condition("Ready", True))
        conds.append(_condition("ContainersReady", True))
    conds.append(_condition("PodScheduled", True))
    return conds


def stamp_conditions(new: list[dict[str, Any]], old: list[dict[str, Any]], now: str) -> list[dict[str, Any]]:
    """Keep lastTransitionTime of conditions whose status did not change."""
    previous = {c.get("type"): c for c in old}
    for cond in new:
        prev = previous.get(cond["type"])
        if prev is not None and prev.get("status") == cond["status"] and prev.get("lastTransitionTime"):
            cond["lastTransitionTime"] = prev["lastTransitionTime"]
        else:
            cond["lastTransitionTime"] = now
    return new


def build_pod_status(
    pod: dict[str, Any], view: PodView, old_conditions: list[dict[str, Any]], now: str
) -> dict[str, Any]:
    """The complete ``.status`` a real kubelet would write for ``view``.

    Every key this simulator ever sets is present (None deletes it in a merge patch), so one merge patch always
    replaces the previous status entirely.
    """
    status: dict[str, Any] = {
        "phase": view.phase,
        "conditions": stamp_conditions(pod_conditions(view), old_conditions, now),
        "qosClass": qos_class(pod),
        "reason": view.reason,
        "message": view.message,
        "hostIP": HOST_IP if view.scheduled else None,
        "podIP": HOST_IP if view.sandbox_ready else None,
        "podIPs": [{"ip": HOST_IP}] if view.sandbox_ready else None,
        "startTime": view.start_time,
        "initContainerStatuses": [container_status(c) for c in view.init] if view.init and view.scheduled else None,
        "containerStatuses": [container_status(c) for c in view.main] if view.scheduled else None,
    }
    return status


def decide_pod_phase(restart_policy: str, exit_codes: list[int | None], pending_restart: bool) -> str:
    """Phase of a pod whose containers have started: ``exit_codes`` has None for a running container."""
    if pending_restart or any(code is None for code in exit_codes):
        return "Running"
    if restart_policy == "Always":
        return "Running"
    if all(code == 0 for code in exit_codes):
        return "Succeeded"
    return "Failed" if restart_policy == "Never" else "Running"


def next_restart_backoff(previous: float | None) -> float:
    """The crash-loop window after ``previous`` (None: a new or expired entry), unscaled: 10, 20, 40, 80, 160, 300,
    300, ... seconds (client-go ``flowcontrol.Backoff.Next`` with the kubelet's 10 s and 300 s)."""
    return RESTART_BACKOFF_START if previous is None else min(2 * previous, RESTART_BACKOFF_MAX)


def go_duration(seconds: float) -> str:
    """Go's ``time.Duration.String()`` for whole seconds, as the kubelet prints a backoff: 10s, 1m20s, 5m0s."""
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


@dataclass
class CrashLoopBackoff:
    """The kubelet's backoff entry for one container of one pod (key: pod name, namespace, UID, container).

    ``doBackOff`` in kuberuntime_manager.go asks ``IsInBackOffSince(key, finishedAt)`` before each start: with no
    entry, or one last updated more than 2 x MaxContainerBackOff (10 min) before this exit, the container starts at
    once; else it waits until ``finishedAt + window``. Each start then calls ``Next``: a new window of 10 s, or the
    old one doubled (capped at 300 s). So a container that crashes right away restarts at once, then after 10, 20,
    40, 80, 160, 300, 300, ... s; one that ran more than 10 min since its last start begins again at once.

    ``scale`` (``--restart-backoff-scale``) multiplies every wait and the 10-minute reset window; the windows kept
    here are the real, unscaled ones.
    """

    scale: float = 1.0
    window: float | None = None  # unscaled seconds; None: no entry
    last_update: float = 0.0  # monotonic time of the last Next (the last start after an exit)

    def delay(self, finished_at: float) -> float:
        """Unscaled seconds the container must wait after exiting at ``finished_at`` (0: restart at once)."""
        if self.window is None or finished_at - self.last_update > 2 * RESTART_BACKOFF_MAX * self.scale:
            self.window = None  # expired: Next starts over
            return 0.0
        return self.window

    def restarted(self, now: float) -> None:
        """``Backoff.Next``, called when the container is started again after an exit."""
        self.window = next_restart_backoff(self.window)
        self.last_update = now


def crash_loop_waits(exits: int, scale: float = 1.0) -> list[float]:
    """Seconds waited before each restart of a container that crashes ``exits`` times right after each start."""
    backoff, clock, waits = CrashLoopBackoff(scale=scale), 0.0, []
    for _ in range(exits):
        wait = backoff.delay(clock) * scale
        waits.append(wait)
        clock += wait
        backoff.restarted(clock)
    return waits


def fallback_message_from_log(log_path: Path) -> str:
    """``FallbackToLogsOnError``: the last 80 lines, at most 2048 bytes, of the container log."""
    try:
        lines = log_path.read_bytes().splitlines()[-FALLBACK_LOG_LINES:]
    except OSError:
        return ""
    content = b"\n".join(line.split(b" ", 1)[1] if b" " in line else b"" for line in lines)
    if lines:
        content += b"\n"
    return content[-FALLBACK_LOG_BYTES:].decode("utf-8", "replace")


# ----------------------------------------------------------------------------------------------------------------
# Ports and cluster names
# ----------------------------------------------------------------------------------------------------------------


class PortMap:
    """One free host port per (namespace, pod-or-Service name, port), shared by all pods."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ports: dict[tuple[str, str, int], int] = {}
        self._next = PORT_RANGE[0] + (os.getpid() * 7) % 1000

    def get(self, namespace: str, name: str, port: int) -> int:
        key = (namespace, name, port)
        with self._lock:
            if key not in self._ports:
                self._ports[key] = self._allocate()
            return self._ports[key]

    def _allocate(self) -> int:
        used = set(self._ports.values())
        span = PORT_RANGE[1] - PORT_RANGE[0]
        for _ in range(span):
            candidate = self._next
            self._next = PORT_RANGE[0] + (self._next + 1 - PORT_RANGE[0]) % span
            if candidate in used:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("0.0.0.0", candidate))
                except OSError:
                    continue
            return candidate
        raise RuntimeError("no free host port left")


# ----------------------------------------------------------------------------------------------------------------
# Errors the pod runner turns into container states
# ----------------------------------------------------------------------------------------------------------------


class ContainerConfigError(Exception):
    """The kubelet cannot build the container's config (missing ConfigMap/Secret key): CreateContainerConfigError."""


class MountError(Exception):
    """A volume cannot be set up (missing ConfigMap/Secret): the pod stays ContainerCreating (FailedMount)."""


class _Stopped(Exception):
    """The pod was deleted: unwind the lifecycle and kill what runs."""

    def __init__(self, grace: float, gone: bool) -> None:
        super().__init__(grace)
        self.grace = grace
        self.gone = gone


# ----------------------------------------------------------------------------------------------------------------
# One container instance
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class ContainerRuntime:
    """Mutable state of one container of a pod across its restarts."""

    spec: dict[str, Any]
    is_init: bool
    restart_count: int = 0
    runs: int = 0  # number of started instances; the log of instance n is logs/<name>/<n>.log
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    container_id: str = ""
    proc: subprocess.Popen[bytes] | None = None
    started_at: str = ""
    oom_killed: bool = False
    restart_at: float | None = None  # monotonic time of the next in-place restart (or config retry)
    restarting: bool = False  # restart_at is an in-place restart after an exit (not a config retry)
    backoff: CrashLoopBackoff = field(default_factory=CrashLoopBackoff)
    oom_at: float | None = None  # monotonic time of an injected OOM kill
    oom_after_line: bytes | None = None  # an OOM kill waiting for this output line (fail-after-log-line)
    init_check_at: float | None = None  # next "nslookup" of the simulated init-pytorch container
    init_tries: int = 0
    term_path: Path | None = None  # host file behind terminationMessagePath
    live: bool = False  # a process (or simulated init) is running; log followers keep streaming while True

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def image(self) -> str:
        return str(self.spec.get("image") or "")

    def view(self) -> ContainerView:
        return ContainerView(
            name=self.name,
            image=self.image,
            state=self.state,
            last_state=self.last_state,
            # The kubelet reports an init container that completed successfully as ready.
            ready=self.ready or (self.is_init and self.exit_code() == 0),
            started="running" in self.state,
            restart_count=self.restart_count,
            container_id=self.container_id,
        )

    def exit_code(self) -> int | None:
        term = self.state.get("terminated")
        return None if term is None else int(term["exitCode"])


# ----------------------------------------------------------------------------------------------------------------
# The pod runner: one thread per pod
# ----------------------------------------------------------------------------------------------------------------


class PodRunner:
    """Drives one pod (one UID) from binding to deletion, in its own thread.

    Everything that happens to the pod arrives as an event on ``self.events`` (process exits, deletion), so the
    thread sleeps until something happens or a timer (restart backoff, OOM kill, eviction) is due.
    """

    def __init__(
        self, kubelet: Kubelet, pod: dict[str, Any], predecessor: PodRunner | None, passive: bool = False
    ) -> None:
        self.kl = kubelet
        # A passive runner stands for a pod that finished before this kubelet started: it only handles deletion.
        self.passive = passive
        self.pod = pod
        meta = pod["metadata"]
        self.ns: str = meta["namespace"]
        self.name: str = meta["name"]
        self.uid: str = meta["uid"]
        self.predecessor = predecessor
        self.events: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.dir: Path = kubelet.workdir / self.ns / self.name
        spec = pod["spec"]
        self.restart_policy: str = spec.get("restartPolicy") or "Always"
        scale = kubelet.restart_backoff_scale
        self.init = [
            ContainerRuntime(c, True, backoff=CrashLoopBackoff(scale)) for c in spec.get("initContainers") or []
        ]
        self.main = [ContainerRuntime(c, False, backoff=CrashLoopBackoff(scale)) for c in spec.get("containers") or []]
        for c in self.init:
            c.state = {"waiting": {"reason": "PodInitializing"}}
        if self.init:
            for c in self.main:
                c.state = {"waiting": {"reason": "PodInitializing"}}
        self.view = PodView(scheduled=bool(spec.get("nodeName")), phase="Pending")
        if passive:
            # Serve the logs a previous kubelet process left behind.
            for c in self.init + self.main:
                c.runs = len(list((self.dir / "logs" / c.name).glob("*.log")))
        self.last_status: dict[str, Any] | None = None
        self.status_dirty = False
        self.stop_requested = False
        self.evict_deadline: float | None = None
        self.finished = threading.Event()
        # ``fail-indexes`` aims a replica template's faults at some of its pods: the others get none.
        annotations = (meta.get("annotations") or {}) if faults_target(meta) else {}
        self.fault = annotations.get(ANN_FAIL)
        if self.fault and self.fault not in FAULTS:
            log.warning("pod %s/%s: unknown %s=%r ignored", self.ns, self.name, ANN_FAIL, self.fault)
            self.fault = None
        self.fault_after = parse_float(annotations.get(ANN_FAIL_AFTER), 1.0) or 0.0
        self.oom_kills = annotations.get(ANN_OOM_KILLS) or OOM_KILLS[0]
        if self.oom_kills not in OOM_KILLS:
            log.warning("pod %s/%s: unknown %s=%r: %s", self.ns, self.name, ANN_OOM_KILLS, self.oom_kills, OOM_KILLS[0])
            self.oom_kills = OOM_KILLS[0]
        after_line = annotations.get(ANN_FAIL_AFTER_LOG_LINE)
        self.fault_after_line = after_line.encode() if after_line else None
        fault_containers = annotations.get(ANN_FAIL_CONTAINER)
        self.fault_containers = {s.strip() for s in fault_containers.split(",")} if fault_containers else None
        self.evict_after = parse_float(annotations.get(ANN_EVICT_AFTER))
        self.start_delay = parse_float(annotations.get(ANN_START_DELAY), 0.0) or 0.0
        # Held containers run no process; they end when the pod is annotated with an exit code.
        self.hold = (meta.get("annotations") or {}).get(ANN_HOLD) == "true"
        self.release_code: int | None = None
        self.grace = min(float(spec.get("terminationGracePeriodSeconds", 30)), MAX_GRACE_SECONDS)
        self.thread = threading.Thread(target=self._run, name=f"pod-{self.ns}/{self.name}", daemon=True)

    # -- public, called from the watch thread ---------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def update(self, pod: dict[str, Any]) -> None:
        self.pod = pod
        meta = pod["metadata"]
        code = (meta.get("annotations") or {}).get(ANN_EXIT_CODE)
        if self.hold and code is not None and self.release_code is None:
            try:
                self.release_code = int(code)
            except ValueError:
                log.warning("pod %s/%s: ignoring non-integer %s=%r", self.ns, self.name, ANN_EXIT_CODE, code)
            else:
                self.events.put(("release",))
        if meta.get("deletionTimestamp"):
            grace = float(meta.get("deletionGracePeriodSeconds") or 0)
            self.events.put(("stop", min(grace, MAX_GRACE_SECONDS), False))

    def gone(self) -> None:
        """The object is gone from the API: kill at once, nothing left to delete."""
        self.events.put(("stop", 0.0, True))

    def find_container(self, name: str) -> ContainerRuntime | None:
        for c in self.init + self.main:
            if c.name == name:
                return c
        return None

    def log_path(self, container: ContainerRuntime, run: int) -> Path:
        return self.dir / "logs" / container.name / f"{run}.log"

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.predecessor is not None:
                # Same name, new UID (the operator recreated the pod): the old pod's processes and files go first.
                self.predecessor.finished.wait(MAX_GRACE_SECONDS + 10)
            if not self.passive:
                self._lifecycle()
            self._wait_forever()  # finished: keep the status current until the pod is deleted
        except _Stopped as stop:
            self._shutdown(stop)
        except Exception as err:
            # A simulator bug must not look like a pod that hangs: fail the pod visibly, then await deletion.
            log.exception("pod %s/%s: runner crashed", self.ns, self.name)
            self._kill_all(0)
            self.view.phase, self.view.reason, self.view.message = "Failed", "SimKubeletError", repr(err)
            try:
                self._wait_forever()
            except _Stopped as stop:
                self._shutdown(stop)
            except Exception:
                log.exception("pod %s/%s: runner crashed twice", self.ns, self.name)
        finally:
            self.finished.set()
            self.kl.forget(self)

    def _lifecycle(self) -> None:
        fault = self.fault
        if fault is not None and fault != "OOMKilled" and not self.kl.take_fault_budget(self.pod, "fail", True):
            fault = None
        if fault == "Unschedulable":
            # The 1.20 scheduler's FitError message (later schedulers append a "preemption: ..." part).
            self.view.unschedulable_message = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
            self._report()
            self.kl.emit_event(
                self.pod, "Warning", "FailedScheduling", self.view.unschedulable_message, "default-scheduler"
            )
            self._wait_forever()
        if not self.view.scheduled:
            self.kl.bind(self.pod)
            self.view.scheduled = True
            self.kl.emit_event(
                self.pod,
                "Normal",
                "Scheduled",
                f"Successfully assigned {self.ns}/{self.name} to {NODE_NAME}",
                "default-scheduler",
            )
        self.view.start_time = now_rfc3339()
        self._report()
        if self.start_delay > 0:
            self._sleep(self.start_delay)
        self._prepare_dirs()
        self._setup_volumes()
        self.view.sandbox_ready = True
        if not self._run_init_containers():
            return
        # Image and config faults hit the app containers: init containers (init-pytorch's alpine) still ran.
        if fault in ("ImagePullBackOff", "ErrImagePull"):
            self._image_pull_failure(fault)
        if fault == "CreateContainerConfigError":
            message = 'secret "sim-injected-missing-secret" not found'
            for c in self._faulted(self.main):
                c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": message}}
                self.kl.emit_event(self.pod, "Warning", "Failed", f"Error: {message}", field_path=c)
            self._report()
            self._wait_forever()
        self._run_main_containers()

    def _wait_forever(self) -> None:
        """Stay as is until the pod is deleted (raises _Stopped)."""
        while True:
            self._wait(1.0 if self.status_dirty else None)
            self._report()

    def _faulted(self, containers: list[ContainerRuntime]) -> list[ContainerRuntime]:
        return [c for c in containers if self.fault_containers is None or c.name in self.fault_containers]

    def _image_pull_failure(self, fault: str) -> None:
        targets = self._faulted(self.main)
        for c in targets:
            ref = c.image if "/" in c.image else f"docker.io/library/{c.image}"
            detail = (
                f'rpc error: code = Unknown desc = failed to pull and unpack image "{ref}": failed to resolve '
                f'reference "{ref}": pull access denied, repository does not exist or may require authorization: '
                "server message: insufficient_scope: authorization failed"
            )
            c.state = {"waiting": {"reason": "ErrImagePull", "message": detail}}
            self.kl.emit_event(self.pod, "Normal", "Pulling", f'Pulling image "{c.image}"', field_path=c)
            self.kl.emit_event(
                self.pod, "Warning", "Failed", f'Failed to pull image "{c.image}": {detail}', field_path=c
            )
            self.kl.emit_event(self.pod, "Warning", "Failed", "Error: ErrImagePull", field_path=c)
        self._report()
        if fault == "ImagePullBackOff":
            self._sleep(1.0)
            for c in targets:
                c.state = {"waiting": {"reason": "ImagePullBackOff", "message": f'Back-off pulling image "{c.image}"'}}
                self.kl.emit_event(self.pod, "Normal", "BackOff", f'Back-off pulling image "{c.image}"', field_path=c)
                self.kl.emit_event(self.pod, "Warning", "Failed", "Error: ImagePullBackOff", field_path=c)
            self._report()
        self._wait_forever()

    def _prepare_dirs(self) -> None:
        if self.dir.exists():
            shutil.rmtree(self.dir, ignore_errors=True)
        (self.dir / "volumes").mkdir(parents=True, exist_ok=True)
        (self.dir / "termination").mkdir(parents=True, exist_ok=True)
        for c in self.init + self.main:
            (self.dir / "logs" / c.name).mkdir(parents=True, exist_ok=True)

    def _setup_volumes(self) -> None:
        """Materialize volumes, retrying like the kubelet's volume manager while a source is missing."""
        warned: set[str] = set()
        while True:
            try:
                self.kl.materialize_volumes(self.pod, self.dir / "volumes")
                return
            except MountError as err:
                if str(err) not in warned:
                    warned.add(str(err))
                    self.kl.emit_event(self.pod, "Warning", "FailedMount", str(err))
                self._sleep(2.0)

    def _run_init_containers(self) -> bool:
        """Run init containers one after another; False when one failed for good (restartPolicy Never)."""
        for c in self.init:
            self._start_container(c)
            self._report()
            while True:
                code = c.exit_code()
                if code == 0:
                    break
                if code is not None and c.restart_at is None:  # terminated and no restart coming
                    self.view.phase = "Failed"
                    self._report()
                    return False
                self._wait(self._timeout())
                self._run_due_timers()
                self._report()
        for c in self.main:
            c.state = {"waiting": {"reason": "ContainerCreating"}}
        return True

    def _run_main_containers(self) -> None:
        for c in self.main:
            self._start_container(c)
        if self.evict_after is not None and self.kl.take_fault_budget(self.pod, "evict", True):
            self.evict_deadline = time.monotonic() + self.evict_after
        while True:
            if self.view.reason != "Evicted":
                if all(c.runs == 0 for c in self.main):
                    self.view.phase = "Pending"  # nothing could start yet (e.g. CreateContainerConfigError)
                else:
                    self.view.phase = decide_pod_phase(
                        self.restart_policy,
                        [c.exit_code() for c in self.main],
                        any(c.restart_at is not None for c in self.main),
                    )
            self._report()
            if self.view.phase in ("Succeeded", "Failed"):
                return
            self._wait(self._timeout())
            self._run_due_timers()

    # -- timers ---------------------------------------------------------------------------------------------------

    def _timers(self) -> list[tuple[float, Callable[[], None]]]:
        timers: list[tuple[float, Callable[[], None]]] = []
        for c in self.init + self.main:
            if c.restart_at is not None:
                timers.append((c.restart_at, functools.partial(self._restart, c)))
            if c.oom_at is not None and c.live:
                timers.append((c.oom_at, functools.partial(self._oom_kill, c)))
            if c.init_check_at is not None and c.live:
                timers.append((c.init_check_at, functools.partial(self._init_pytorch_step, c)))
        if self.evict_deadline is not None:
            timers.append((self.evict_deadline, self._evict))
        if self.status_dirty:
            timers.append((time.monotonic() + 1.0, lambda: None))
        return timers

    def _timeout(self) -> float | None:
        timers = self._timers()
        if not timers:
            return None
        return max(0.0, min(t for t, _ in timers) - time.monotonic())

    def _run_due_timers(self) -> None:
        now = time.monotonic()
        for at, action in self._timers():
            if at <= now:
                action()

    # -- events ---------------------------------------------------------------------------------------------------

    def _wait(self, timeout: float | None) -> None:
        """Handle one event (or time out); raises _Stopped on deletion."""
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        self._handle(event, raise_on_stop=True)

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self._wait(left)

    def _handle(self, event: tuple[Any, ...], raise_on_stop: bool) -> None:
        kind = event[0]
        if kind == "exit":
            _, container, proc, returncode = event
            if container.proc is proc:
                self._on_exit(container, returncode)
        elif kind == "release" and self.release_code is not None:
            for c in self.main:
                if c.live and c.proc is None:
                    self._on_exit(c, self.release_code)
        elif kind == "stop":
            _, grace, gone = event
            self.stop_requested = True
            if raise_on_stop:
                raise _Stopped(grace, gone)

    # -- containers -----------------------------------------------------------------------------------------------

    def _start_container(self, c: ContainerRuntime) -> None:
        """Start one instance of ``c``; a failure to build its config leaves it waiting and retries."""
        c.restart_at = None
        c.oom_killed = False
        c.oom_after_line = None
        c.container_id = f"docker://{random_hex64()}"
        log_path = self.log_path(c, c.runs)
        c.runs += 1
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_bytes(b"")
        c.started_at = now_rfc3339()
        if self.hold and not c.is_init:
            c.live, c.ready = True, True
            c.state = {"running": {"startedAt": c.started_at}}
            if self.release_code is not None:  # told to end before it started
                self.events.put(("release",))
            return
        if c.is_init and self._is_init_pytorch(c.spec):
            # The operator's "until nslookup <master>" loop: simulated, the master's DNS record exists once it runs.
            c.live = True
            c.state = {"running": {"startedAt": c.started_at}}
            c.init_tries = 0
            c.init_check_at = time.monotonic()
            return
        try:
            config = self.kl.container_process_config(self.pod, c.spec, self.dir)
        except ContainerConfigError as err:
            c.container_id = ""
            c.runs -= 1
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(err)}}
            self.kl.emit_event(self.pod, "Warning", "Failed", f"Error: {err}", field_path=c)
            c.restart_at = time.monotonic() + 2.0
            return
        argv, term_path = config.argv, config.term_path
        c.term_path = term_path
        term_path.parent.mkdir(parents=True, exist_ok=True)
        term_path.write_bytes(b"")  # a fresh termination-log file per container instance, as the kubelet mounts one
        # A restarted container gets a new writable layer: nothing of the previous instance's files (volumes stay).
        shutil.rmtree(config.container_dir, ignore_errors=True)
        for path in (config.cwd, config.home, config.tmp):
            path.mkdir(parents=True, exist_ok=True)
        if c.runs == 1:
            self.kl.emit_event(
                self.pod, "Normal", "Pulled", f'Container image "{c.image}" already present on machine', field_path=c
            )
        self.kl.emit_event(self.pod, "Normal", "Created", f"Created container {c.name}", field_path=c)
        try:
            proc = subprocess.Popen(
                argv,
                env=config.env,
                cwd=str(config.cwd),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except (OSError, ValueError) as err:
            # What containerd reports when the entrypoint cannot be executed.
            reason = err.strerror if isinstance(err, OSError) else str(err)
            message = (
                f"failed to create containerd task: failed to create shim task: OCI runtime create failed: "
                f'runc create failed: unable to start container process: exec: "{argv[0] if argv else ""}": {reason}'
            )
            with log_path.open("ab") as f:
                f.write(f"{log_timestamp()} {message}\n".encode())
            c.state = {
                "terminated": {
                    "exitCode": 128,
                    "reason": "StartError",
                    "message": message,
                    "startedAt": "1970-01-01T00:00:00Z",
                    "finishedAt": now_rfc3339(),
                    "containerID": c.container_id,
                }
            }
            self.kl.emit_event(self.pod, "Warning", "Failed", f"Error: {message}", field_path=c)
            self._after_termination(c, 128)
            return
        self.kl.record_pgid(proc.pid)
        c.proc = proc
        c.live = True
        c.state = {"running": {"startedAt": c.started_at}}
        c.ready = not c.is_init
        self.kl.emit_event(self.pod, "Normal", "Started", f"Started container {c.name}", field_path=c)
        # Armed before the output is read: a line the process prints at once must not pass the pump unwatched (a
        # loaded machine can hold this thread back while the pump reads).
        if not c.is_init and self.fault == "OOMKilled" and c in self._faulted(self.main):
            if not self.kl.take_fault_budget(self.pod, "fail", True):
                c.oom_at = None
            elif self.fault_after_line is None:
                c.oom_at = time.monotonic() + self.fault_after
            else:
                c.oom_at, c.oom_after_line = None, self.fault_after_line  # armed by _pump, on that line
        threading.Thread(
            target=self._watch_process, args=(c, proc, log_path), daemon=True, name=f"proc-{proc.pid}"
        ).start()

    def _watch_process(self, c: ContainerRuntime, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        """Pump the output into the log; when the main process exits, kill the rest of its group (the container's
        PID namespace dies with PID 1) and report the exit."""
        pump = threading.Thread(target=self._pump, args=(c, proc, log_path), daemon=True)
        pump.start()
        returncode = proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        pump.join(timeout=5)
        self.events.put(("exit", c, proc, returncode))

    def _pump(self, c: ContainerRuntime, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        assert proc.stdout is not None
        with log_path.open("ab", buffering=0) as out:
            for line in iter(proc.stdout.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                out.write(log_timestamp().encode() + b" " + line)
                if c.oom_after_line is not None and c.oom_after_line in line and c.proc is proc:
                    c.oom_after_line = None
                    c.oom_at = time.monotonic() + self.fault_after
                    self.events.put(("timers",))  # wake the pod's loop: its next timer changed
        proc.stdout.close()

    def _on_exit(self, c: ContainerRuntime, returncode: int) -> None:
        code = exit_code_of(returncode)
        c.proc = None
        c.live = False
        c.ready = False
        c.oom_at = None
        # containerd keeps an OOM event's reason whatever the exit code: 137 when the main process was killed, the
        # runner's own code when the kernel killed one of its workers.
        reason = "OOMKilled" if c.oom_killed else "Completed" if code == 0 else "Error"
        message = self._termination_message(c, code)
        terminated: dict[str, Any] = {
            "exitCode": code,
            "reason": reason,
            "startedAt": c.started_at,
            "finishedAt": now_rfc3339(),
            "containerID": c.container_id,
        }
        if message:
            terminated["message"] = message
        c.state = {"terminated": terminated}
        self._after_termination(c, code)

    def _termination_message(self, c: ContainerRuntime, code: int) -> str:
        path = c.term_path
        message = ""
        if path is not None:
            try:
                with path.open("rb") as f:
                    message = f.read(MAX_TERMINATION_MESSAGE).decode("utf-8", "replace")
            except OSError:
                message = ""
        policy = c.spec.get("terminationMessagePolicy") or "File"
        if not message and code != 0 and policy == "FallbackToLogsOnError":
            message = fallback_message_from_log(self.log_path(c, c.runs - 1))
        return message

    def _after_termination(self, c: ContainerRuntime, code: int) -> None:
        """Schedule an in-place restart when the pod's restartPolicy asks for one."""
        evicted = self.view.reason == "Evicted"
        wants_restart = self.restart_policy == "Always" or (self.restart_policy == "OnFailure" and code != 0)
        if c.is_init:
            wants_restart = self.restart_policy != "Never" and code != 0
        if not wants_restart or evicted or self.stop_requested:
            return
        now = time.monotonic()
        window = c.backoff.delay(now)
        c.restart_at = now + window * c.backoff.scale
        c.restarting = True
        if window <= 0:
            return  # the first exit (or the first after a long run): started again at once, no CrashLoopBackOff
        c.last_state = c.state
        c.state = {
            "waiting": {
                "reason": "CrashLoopBackOff",
                # The real (unscaled) window, in Go's format, as a real kubelet writes it.
                "message": (
                    f"back-off {go_duration(window)} restarting failed container={c.name} "
                    f"pod={self.name}_{self.ns}({self.uid})"
                ),
            }
        }
        self.kl.emit_event(self.pod, "Warning", "BackOff", "Back-off restarting failed container", field_path=c)

    def _restart(self, c: ContainerRuntime) -> None:
        """An in-place restart after backoff, or another try at building the container's config."""
        c.restart_at = None
        if c.restarting:
            # restartCount counts the restarts done: it goes up when the new instance starts, as on a real node.
            c.restarting = False
            if "terminated" in c.state:
                c.last_state = c.state
            c.restart_count += 1
            c.backoff.restarted(time.monotonic())
        self._start_container(c)
        self._report()

    def _oom_kill(self, c: ContainerRuntime) -> None:
        c.oom_at = None
        if c.proc is None:
            return
        c.oom_killed = True
        victim = largest_descendant(c.proc.pid) if self.oom_kills == "worker" else None
        if victim is None:
            self._signal(c, signal.SIGKILL)
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(victim, signal.SIGKILL)

    def _init_pytorch_step(self, c: ContainerRuntime) -> None:
        """One iteration of ``until nslookup <master>; do echo waiting for master; sleep 2; done``."""
        target = self._nslookup_target(c.spec)
        c.init_tries += 1
        tries = c.init_tries
        log_path = self.log_path(c, c.runs - 1)
        master = self.kl.cached_pod(self.ns, target or "")
        with log_path.open("ab") as f:
            if master is not None and (master.get("status") or {}).get("phase") == "Running":
                f.write(
                    (
                        f"{log_timestamp()} Server:\t\t10.96.0.10\n{log_timestamp()} Address:\t10.96.0.10:53\n"
                        f"{log_timestamp()} \n{log_timestamp()} Name:\t{target}.{self.ns}.svc.cluster.local\n"
                        f"{log_timestamp()} Address: {HOST_IP}\n"
                    ).encode()
                )
                code: int | None = 0
            else:
                stamp = log_timestamp()
                f.write(f"{stamp} nslookup: can't resolve '{target}'\n{stamp} waiting for master\n".encode())
                code = 1 if tries >= INIT_PYTORCH_TRIES else None
        if code is None:
            c.init_check_at = time.monotonic() + INIT_PYTORCH_SLEEP
            return
        c.init_check_at = None
        c.live = False
        c.state = {
            "terminated": {
                "exitCode": code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": c.started_at,
                "finishedAt": now_rfc3339(),
                "containerID": c.container_id,
            }
        }
        self._after_termination(c, code)

    @staticmethod
    def _nslookup_target(spec: dict[str, Any]) -> str | None:
        text = " ".join([*(spec.get("command") or []), *(spec.get("args") or [])])
        match = re.search(r"nslookup\s+([a-z0-9][-a-z0-9.]*)", text)
        return match.group(1).split(".")[0] if match else None

    def _is_init_pytorch(self, spec: dict[str, Any]) -> bool:
        return spec.get("name") == "init-pytorch" and self._nslookup_target(spec) is not None

    def _evict(self) -> None:
        self.evict_deadline = None
        usage = "1Gi"
        message = (
            f"The node was low on resource: memory. Threshold quantity: 100Mi, available: 92Mi. "
            f"Container {self.main[0].name if self.main else ''} was using {usage}, which exceeds its request of 0. "
        )
        self.view.reason = "Evicted"
        self.view.message = message
        self.view.disruption_message = message
        self.kl.emit_event(self.pod, "Warning", "Evicted", message)
        for c in self.main:
            c.restart_at, c.restarting = None, False
            if c.proc is not None:
                self.kl.emit_event(self.pod, "Normal", "Killing", f"Stopping container {c.name}", field_path=c)
        self._kill_all(self.grace)
        for c in self.main:
            if "terminated" not in c.state:
                c.state = {
                    "terminated": {
                        "exitCode": 137,
                        "reason": "ContainerStatusUnknown",
                        "message": "The container could not be located when the pod was terminated",
                        "startedAt": c.started_at or now_rfc3339(),
                        "finishedAt": now_rfc3339(),
                    }
                }
        self.view.phase = "Failed"
        self._report()

    def _signal(self, c: ContainerRuntime, sig: signal.Signals) -> None:
        if c.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.proc.pid, sig)

    def _kill_all(self, grace: float) -> None:
        """SIGTERM every running container, SIGKILL after ``grace`` seconds, and collect their exits."""
        for c in self.init + self.main:
            c.restart_at, c.restarting = None, False
            if c.live and c.proc is None:  # the simulated init container
                c.live = False
            self._signal(c, signal.SIGTERM)
        deadline = time.monotonic() + grace
        killed = False
        while any(c.proc is not None for c in self.init + self.main):
            left = deadline - time.monotonic()
            if left <= 0 and not killed:
                for c in self.init + self.main:
                    self._signal(c, signal.SIGKILL)
                killed = True
                deadline = time.monotonic() + 5.0
                continue
            if left <= 0:
                break
            try:
                event = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if event[0] == "stop":
                deadline = min(deadline, time.monotonic() + float(event[1]))
            self._handle(event, raise_on_stop=False)

    def _shutdown(self, stop: _Stopped) -> None:
        self._kill_all(stop.grace)
        if not stop.gone:
            self.kl.finish_deletion(self.ns, self.name, self.uid)

    # -- status ---------------------------------------------------------------------------------------------------

    def _report(self) -> None:
        if self.passive:
            return
        pod = self.pod
        view = self.view
        view.init = [c.view() for c in self.init]
        view.main = [c.view() for c in self.main]
        old = (self.last_status or pod.get("status") or {}).get("conditions") or []
        status = build_pod_status(pod, view, old, now_rfc3339())
        if self.last_status is not None and _same_status(status, self.last_status) and not self.status_dirty:
            return
        try:
            self.kl.patch_pod_status(self.ns, self.name, self.uid, status)
            self.last_status = status
            self.status_dirty = False
        except ApiException as err:
            if err.status in (404, 409, 422):  # gone, or recreated under the same name (UID mismatch)
                self.events.put(("stop", 0.0, True))
            else:
                log.warning("pod %s/%s: status update failed (%s); retrying", self.ns, self.name, err.status)
                self.status_dirty = True
        except Exception as err:  # connection trouble: retry on the next pass
            log.warning("pod %s/%s: status update failed (%s); retrying", self.ns, self.name, err)
            self.status_dirty = True


def _same_status(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal apart from condition transition times (which only change when a status changes anyway)."""

    def strip(s: dict[str, Any]) -> str:
        copy = dict(s)
        copy["conditions"] = [
            {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in s.get("conditions") or []
        ]
        return json.dumps(copy, sort_keys=True)

    return strip(a) == strip(b)


# ----------------------------------------------------------------------------------------------------------------
# The log server
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogQuery:
    follow: bool = False
    previous: bool = False
    timestamps: bool = False
    tail_lines: int | None = None
    since: float | None = None  # epoch seconds
    limit_bytes: int | None = None

    @staticmethod
    def parse(query: str) -> LogQuery:
        params = urllib.parse.parse_qs(query)

        def flag(name: str) -> bool:
            # The Python client sends True/False; Go's ParseBool accepts 1, t, T, TRUE, true, True.
            return params.get(name, ["false"])[-1] in ("1", "t", "T", "TRUE", "true", "True")

        def integer(name: str) -> int | None:
            return int(params[name][-1]) if name in params else None

        since: float | None = None
        if "sinceSeconds" in params:
            since = time.time() - int(params["sinceSeconds"][-1])
        elif "sinceTime" in params:
            since = parse_timestamp(params["sinceTime"][-1])
        return LogQuery(
            follow=flag("follow"),
            previous=flag("previous"),
            timestamps=flag("timestamps"),
            tail_lines=integer("tailLines"),
            since=since,
            limit_bytes=integer("limitBytes"),
        )


def select_log_lines(lines: list[bytes], query: LogQuery) -> list[bytes]:
    """Filter stored ``<ts> <content>`` lines by sinceSeconds/sinceTime, then tailLines; format per timestamps."""
    if query.since is not None:
        lines = [line for line in lines if _line_time(line) >= query.since]
    if query.tail_lines is not None:
        lines = lines[-query.tail_lines :] if query.tail_lines > 0 else []
    return [format_log_line(line, query.timestamps) for line in lines]


def format_log_line(line: bytes, timestamps: bool) -> bytes:
    return line if timestamps else line.split(b" ", 1)[1] if b" " in line else line


def _line_time(line: bytes) -> float:
    try:
        return parse_timestamp(line.split(b" ", 1)[0].decode())
    except ValueError:
        return 0.0


@dataclass(frozen=True)
class LogSource:
    path: Path
    is_live: Callable[[], bool]  # True while the container instance may still write to ``path``


@dataclass(frozen=True)
class LogError:
    """What the kubelet answers instead of a log (the apiserver passes it on as the API error)."""

    status: int
    message: str


class LogHandler(BaseHTTPRequestHandler):
    """``GET /containerLogs/{ns}/{pod}/{container}``, the kubelet endpoint the apiserver proxies pods/log to."""

    server_version = "sim-kubelet"
    kubelet: Kubelet  # set on the subclass by Kubelet.start_log_server

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("log server: " + format, *args)

    def _error(self, code: int, message: str) -> None:
        body = message.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        parts = [urllib.parse.unquote(p) for p in url.path.split("/") if p]
        if len(parts) != 4 or parts[0] != "containerLogs":
            self._error(404, "404 page not found")
            return
        _, ns, pod, container = parts
        try:
            query = LogQuery.parse(url.query)
        except ValueError as err:
            self._error(400, str(err))
            return
        source = self.kubelet.log_source(ns, pod, container, query.previous)
        if isinstance(source, LogError):
            self._error(source.status, source.message)
            return
        path, is_live = source.path, source.is_live
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Connection", "close")
        self.end_headers()
        with contextlib.suppress(OSError):  # the client went away (BrokenPipe, ConnectionReset, SSL errors)
            self._stream(path, is_live, query)

    def _stream(self, path: Path, is_live: Callable[[], bool], query: LogQuery) -> None:
        budget = query.limit_bytes

        def send(chunk: bytes) -> bool:
            nonlocal budget
            if budget is not None:
                chunk = chunk[:budget]
                budget -= len(chunk)
            if chunk:
                self.wfile.write(chunk)
            return budget is None or budget > 0

        with path.open("rb") as f:
            data = f.read()
            offset = data.rfind(b"\n") + 1  # serve complete lines only; a partial one comes when it is finished
            lines = data[:offset].split(b"\n")[:-1]
            for line in select_log_lines(lines, query):
                if not send(line + b"\n"):
                    return
            if not query.follow:
                return
            f.seek(offset)
            pending = b""
            while True:
                live = is_live()  # read before the data, so nothing written before the exit is missed
                chunk = f.read()
                if chunk:
                    pending += chunk
                    *done, pending = pending.split(b"\n")
                    for line in done:
                        if query.since is not None and _line_time(line) < query.since:
                            continue
                        if not send(format_log_line(line, query.timestamps) + b"\n"):
                            return
                    continue
                if not live:
                    return
                time.sleep(0.2)


def generate_self_signed_cert(cert_path: Path, key_path: Path) -> None:
    """A throwaway serving certificate for 127.0.0.1; the apiserver does not verify kubelet certificates unless
    ``--kubelet-certificate-authority`` is set."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{NODE_NAME}@{int(time.time())}")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=365))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(HOST_IP))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


# ----------------------------------------------------------------------------------------------------------------
# List + watch
# ----------------------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------------------
# The kubelet
# ----------------------------------------------------------------------------------------------------------------


class Kubelet:
    def __init__(
        self, api: client.ApiClient, workdir: Path, runner_python: Path, restart_backoff_scale: float = 1.0
    ) -> None:
        if not restart_backoff_scale > 0:
            raise ValueError(f"restart_backoff_scale must be > 0, got {restart_backoff_scale!r}")
        self.api = api
        #: Test-only: multiplies crash-loop waits (``--restart-backoff-scale``); 1 is the real kubelet's timing.
        self.restart_backoff_scale = restart_backoff_scale
        self.core = client.CoreV1Api(api)
        self.workdir = workdir
        self.runner_python = runner_python
        # The API server as the cluster knows it: what this kubelet itself talks to.
        server = urllib.parse.urlsplit(api.configuration.host)
        self.api_host = server.hostname or HOST_IP
        self.api_port = server.port or 443
        self.ports = PortMap()
        self.stop = threading.Event()
        self._lock = threading.RLock()
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}  # every pod of the cluster, for name lookups
        self._runners: dict[tuple[str, str], PodRunner] = {}
        self._fault_counts: dict[tuple[str, ...], int] = {}
        self._pgid_lock = threading.Lock()
        self._binary_keys: dict[tuple[str, str, str], set[str]] = {}  # binaryData keys of the last read source
        self._name_cache: dict[tuple[str, str], tuple[bool, float]] = {}  # (exists, valid until)
        self.port = 0

    # -- node and log server --------------------------------------------------------------------------------------

    def start_log_server(self) -> None:
        cert, key = self.workdir / "kubelet.crt", self.workdir / "kubelet.key"
        generate_self_signed_cert(cert, key)
        handler = type("BoundLogHandler", (LogHandler,), {"kubelet": self})
        server = ThreadingHTTPServer((HOST_IP, 0), handler)
        server.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, name="log-server", daemon=True).start()
        log.info("log server on https://%s:%d", HOST_IP, self.port)

    def node_status(self) -> dict[str, Any]:
        now = now_rfc3339()
        resources = {"cpu": str(os.cpu_count() or 2), "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi"}
        return {
            # No Hostname address: the apiserver prefers it for pods/log and "sim-node-0" does not resolve.
            "addresses": [{"type": "InternalIP", "address": HOST_IP}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.port}},
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
            "nodeInfo": {
                "machineID": hashlib.md5(NODE_NAME.encode()).hexdigest(),
                "systemUUID": hashlib.md5(b"uuid" + NODE_NAME.encode()).hexdigest(),
                "bootID": hashlib.md5(str(os.getpid()).encode()).hexdigest(),
                "kernelVersion": os.uname().release,
                "osImage": "sim-kubelet (processes on the host)",
                "containerRuntimeVersion": "docker://20.10.24",
                "kubeletVersion": "v1.20.2",
                "kubeProxyVersion": "v1.20.2",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }

    def register_node(self) -> None:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": NODE_NAME,
                "labels": {
                    "kubernetes.io/hostname": NODE_NAME,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "beta.kubernetes.io/os": "linux",
                    "beta.kubernetes.io/arch": "amd64",
                },
            },
            "spec": {},
            "status": self.node_status(),
        }
        try:
            self.core.create_node(node, _preload_content=False)
        except ApiException as err:
            if err.status != 409:
                raise
        # Always write the status too: an existing Node (a restarted kubelet) must get the new log server port.
        self.core.patch_node_status(
            NODE_NAME, {"status": self.node_status()}, _content_type=PATCH_MERGE, _preload_content=False
        )
        log.info("node %s registered (kubelet port %d)", NODE_NAME, self.port)

    # -- pod bookkeeping ------------------------------------------------------------------------------------------

    def on_relist(self, pods: list[dict[str, Any]]) -> None:
        seen = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in pods}
        with self._lock:
            for key in list(self._pods):
                if key not in seen:
                    self.on_event("DELETED", self._pods[key])
        for pod in pods:
            self.on_event("MODIFIED", pod)

    def on_event(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        node = (pod.get("spec") or {}).get("nodeName")
        with self._lock:
            if kind == "DELETED":
                if self._pods.get(key, {}).get("metadata", {}).get("uid") == meta["uid"]:
                    del self._pods[key]
                runner = self._runners.get(key)
                if runner is not None and runner.uid == meta["uid"]:
                    runner.gone()
                return
            self._pods[key] = pod
            if node and node != NODE_NAME:
                return  # another node's pod
            runner = self._runners.get(key)
            if runner is not None and runner.uid == meta["uid"]:
                runner.update(pod)
                return
            if meta.get("deletionTimestamp"):
                if runner is None:
                    self._strip_gc_finalizers(pod)
                    # A terminating pod that nothing runs (e.g. after a kubelet restart): just remove it.
                    threading.Thread(
                        target=self.finish_deletion, args=(key[0], key[1], meta["uid"]), daemon=True
                    ).start()
                return
            phase = (pod.get("status") or {}).get("phase")
            if node == NODE_NAME and phase in ("Succeeded", "Failed") and runner is None:
                # Finished before this kubelet started: nothing to run, but deletion must still be handled.
                runner = PodRunner(self, pod, None, passive=True)
            else:
                runner = PodRunner(self, pod, runner)
            self._runners[key] = runner
        runner.start()

    def forget(self, runner: PodRunner) -> None:
        with self._lock:
            if self._runners.get((runner.ns, runner.name)) is runner:
                del self._runners[(runner.ns, runner.name)]

    def cached_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._pods.get((namespace, name))

    def take_fault_budget(self, pod: dict[str, Any], kind: str, consume: bool) -> bool:
        """Whether a fault of ``kind`` may still be injected for this pod name (``fail-times``)."""
        meta = pod["metadata"]
        limit = parse_float((meta.get("annotations") or {}).get(ANN_FAIL_TIMES))
        if limit is None:
            return True
        key = fault_budget_key(meta, kind)
        with self._lock:
            used = self._fault_counts.get(key, 0)
            if used >= limit:
                return False
            if consume:
                self._fault_counts[key] = used + 1
            return True

    def record_pgid(self, pgid: int) -> None:
        with self._pgid_lock, (self.workdir / "pgids").open("a") as f:
            f.write(f"{pgid}\n")

    # -- API writes -----------------------------------------------------------------------------------------------

    def bind(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": NODE_NAME},
        }
        # The response is a Status, which the client's V1Binding model cannot hold: skip deserialization.
        self.core.create_namespaced_pod_binding(meta["name"], meta["namespace"], body, _preload_content=False)

    def patch_pod_status(self, namespace: str, name: str, uid: str, status: dict[str, Any]) -> None:
        # The UID makes the apiserver refuse to patch a new pod that reuses the name.
        body = {"metadata": {"uid": uid}, "status": status}
        self.core.patch_namespaced_pod_status(name, namespace, body, _content_type=PATCH_MERGE, _preload_content=False)

    def _strip_gc_finalizers(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        finalizers = meta.get("finalizers") or []
        if finalizers and set(finalizers) <= GC_FINALIZERS:
            try:
                self.core.patch_namespaced_pod(
                    meta["name"],
                    meta["namespace"],
                    {"metadata": {"finalizers": None, "uid": meta["uid"]}},
                    _content_type=PATCH_MERGE,
                    _preload_content=False,
                )
            except ApiException as err:
                if err.status not in (404, 409, 422):
                    log.warning("pod %s: could not remove GC finalizers: %s", meta["name"], err.status)

    def finish_deletion(self, namespace: str, name: str, uid: str) -> None:
        """After the containers died: remove the object, as the kubelet does with a zero grace period."""
        pod = self.cached_pod(namespace, name)
        if pod is not None and pod["metadata"]["uid"] == uid:
            self._strip_gc_finalizers(pod)
        body = client.V1DeleteOptions(grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid))
        try:
            self.core.delete_namespaced_pod(name, namespace, body=body, _preload_content=False)
        except ApiException as err:
            if err.status not in (404, 409):
                log.warning("pod %s/%s: final delete failed: %s", namespace, name, err.status)

    def emit_event(
        self,
        pod: dict[str, Any],
        event_type: str,
        reason: str,
        message: str,
        component: str = "kubelet",
        field_path: ContainerRuntime | None = None,
    ) -> None:
        """Best effort, like the kubelet's event recorder."""
        meta = pod["metadata"]
        now = now_rfc3339()
        involved: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
        }
        if field_path is not None:
            kind = "initContainers" if field_path.is_init else "containers"
            involved["fieldPath"] = f"spec.{kind}{{{field_path.name}}}"
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{time.time_ns():x}", "namespace": meta["namespace"]},
            "involvedObject": involved,
            "reason": reason,
            "message": message,
            "type": event_type,
            "source": {"component": component, **({"host": NODE_NAME} if component == "kubelet" else {})},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "reportingComponent": component,
            "reportingInstance": NODE_NAME if component == "kubelet" else "",
        }
        try:
            self.core.create_namespaced_event(meta["namespace"], event, _preload_content=False)
        except Exception as err:
            log.debug("event %s for %s not recorded: %s", reason, meta["name"], err)

    # -- volumes --------------------------------------------------------------------------------------------------

    def _read_source(self, kind: str, namespace: str, name: str, optional: bool) -> dict[str, bytes] | None:
        """ConfigMap/Secret contents as bytes per key; None for a missing optional source."""
        try:
            if kind == "configmap":
                resp = self.core.read_namespaced_config_map(name, namespace, _preload_content=False)
            else:
                resp = self.core.read_namespaced_secret(name, namespace, _preload_content=False)
        except ApiException as err:
            if err.status == 404:
                if optional:
                    return None
                raise MountError(f'{kind} "{name}" not found') from err
            raise
        obj = json.loads(resp.data)
        data: dict[str, bytes] = {}
        self._binary_keys[(kind, namespace, name)] = set(obj.get("binaryData") or {})
        if kind == "configmap":
            data.update({k: v.encode() for k, v in (obj.get("data") or {}).items()})
            data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        else:
            data.update({k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()})
            data.update({k: v.encode() for k, v in (obj.get("stringData") or {}).items()})
        return data

    @staticmethod
    def _write_items(
        target: Path, data: dict[str, bytes], items: list[dict[str, Any]] | None, mode: int | None, what: str
    ) -> None:
        target.mkdir(parents=True, exist_ok=True)
        selected: list[tuple[str, bytes, int | None]] = []
        if items:
            for item in items:
                if item["key"] not in data:
                    raise MountError(
                        f"configmap references non-existent config key: {item['key']}"
                        if what == "configmap"
                        else f"references non-existent secret key: {item['key']}"
                    )
                selected.append((item["path"], data[item["key"]], item.get("mode")))
        else:
            selected = [(key, value, None) for key, value in data.items()]
        for rel, content, item_mode in selected:
            path = target / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
            os.chmod(path, item_mode if item_mode is not None else (mode if mode is not None else 0o644))

    def materialize_volumes(self, pod: dict[str, Any], root: Path) -> None:
        namespace = pod["metadata"]["namespace"]
        for volume in pod["spec"].get("volumes") or []:
            target = root / volume["name"]
            if "configMap" in volume:
                src = volume["configMap"]
                data = self._read_source("configmap", namespace, src["name"], bool(src.get("optional")))
                self._write_items(target, data or {}, src.get("items"), src.get("defaultMode"), "configmap")
            elif "secret" in volume:
                src = volume["secret"]
                try:
                    data = self._read_source("secret", namespace, src["secretName"], bool(src.get("optional")))
                except MountError as err:
                    raise MountError(f'MountVolume.SetUp failed for volume "{volume["name"]}" : {err}') from err
                self._write_items(target, data or {}, src.get("items"), src.get("defaultMode"), "secret")
            elif "downwardAPI" in volume:
                target.mkdir(parents=True, exist_ok=True)
                for item in volume["downwardAPI"].get("items") or []:
                    if "fieldRef" in item:
                        value = field_ref_value(pod, item["fieldRef"]["fieldPath"])
                        (target / item["path"]).parent.mkdir(parents=True, exist_ok=True)
                        (target / item["path"]).write_text(value)
            elif "projected" in volume:
                target.mkdir(parents=True, exist_ok=True)
                for source in volume["projected"].get("sources") or []:
                    if "configMap" in source:
                        src = source["configMap"]
                        data = self._read_source("configmap", namespace, src["name"], bool(src.get("optional")))
                        self._write_items(target, data or {}, src.get("items"), None, "configmap")
                    elif "secret" in source:
                        src = source["secret"]
                        data = self._read_source("secret", namespace, src["name"], bool(src.get("optional")))
                        self._write_items(target, data or {}, src.get("items"), None, "secret")
            elif "hostPath" in volume:
                continue  # the host path itself is used
            else:
                # emptyDir (any medium), PVCs and everything else: an empty directory.
                target.mkdir(parents=True, exist_ok=True)

    def mounts_for(self, pod: dict[str, Any], spec: dict[str, Any], pod_dir: Path) -> list[tuple[str, str]]:
        """(container path, host path) for each volumeMount, longest container path first."""
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        mounts: list[tuple[str, str]] = []
        for mount in spec.get("volumeMounts") or []:
            volume = volumes.get(mount["name"], {})
            host = Path(volume["hostPath"]["path"]) if "hostPath" in volume else pod_dir / "volumes" / mount["name"]
            if mount.get("subPath"):
                host = host / mount["subPath"]
            mounts.append((mount["mountPath"], str(host)))
        mounts.sort(key=lambda m: len(m[0]), reverse=True)
        return mounts

    # -- env and networking ---------------------------------------------------------------------------------------

    def resolve_cluster_host(self, host: str, namespace: str) -> tuple[str, str] | None:
        """(namespace, name) when ``host`` names a pod or Service of the cluster (or a pod by its
        ``hostname.subdomain``: then the name is the pod's)."""
        by_hostname = self.resolve_pod_hostname(host, namespace)
        if by_hostname is not None:
            return by_hostname
        target = split_cluster_host(host, namespace)
        if target is None:
            return None
        ns, name = target
        if self.cached_pod(ns, name) is not None:
            return target
        with self._lock:
            cached = self._name_cache.get((ns, name))
        if cached is not None and cached[1] > time.monotonic():
            return target if cached[0] else None
        # The pod cache may lag behind the apiserver, and Services are not cached: ask (and remember briefly).
        found = False
        for reader in (self.core.read_namespaced_service, self.core.read_namespaced_pod):
            try:
                reader(name, ns, _preload_content=False)
                found = True
                break
            except ApiException:
                continue
            except Exception:
                return None
        with self._lock:
            self._name_cache[(ns, name)] = (found, time.monotonic() + (300.0 if found else 2.0))
        return target if found else None

    def resolve_pod_hostname(self, host: str, namespace: str) -> tuple[str, str] | None:
        """(namespace, pod name) of the pod that ``hostname.subdomain[.ns...]`` names: a known pod with that
        ``spec.hostname`` and ``spec.subdomain`` that a headless Service named as the subdomain selects (an active
        pod before a finished one, then the newest)."""
        target = split_pod_hostname(host, namespace)
        if target is None:
            return None
        ns, hostname, subdomain = target
        with self._lock:
            candidates = [
                p
                for (pns, _), p in self._pods.items()
                if pns == ns
                and (p.get("spec") or {}).get("hostname") == hostname
                and (p.get("spec") or {}).get("subdomain") == subdomain
            ]
        if not candidates:
            return None
        selector = self._headless_selector(ns, subdomain)
        if not selector:
            return None
        matching = [
            p for p in candidates if all((p["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())
        ]
        if not matching:
            return None

        def rank(p: dict[str, Any]) -> tuple[bool, str]:
            phase = (p.get("status") or {}).get("phase")
            live = phase not in ("Succeeded", "Failed") and not p["metadata"].get("deletionTimestamp")
            return (live, str(p["metadata"].get("creationTimestamp") or ""))

        return ns, max(matching, key=rank)["metadata"]["name"]

    def hosts_rdzv_store(self, pod: dict[str, Any], endpoint: str) -> bool | None:
        """Whether this pod is the host of the c10d ``endpoint`` (None: the host is no pod or Service here).

        On a real cluster the name resolves to pod IPs, and torch hosts the store on the machine whose address it
        is: the pod of that name, or a pod a headless Service of that name selects. A ClusterIP Service's
        virtual IP is no pod's address, so no pod hosts the store behind one.
        """
        meta = pod["metadata"]
        target = self.resolve_cluster_host(endpoint_host(endpoint), meta["namespace"])
        if target is None:
            return None
        if target == (meta["namespace"], meta["name"]):
            return True
        selector = self._headless_selector(*target)
        labels = meta.get("labels") or {}
        return bool(selector) and all(labels.get(k) == v for k, v in (selector or {}).items())

    def _headless_selector(self, namespace: str, name: str) -> dict[str, str] | None:
        """The selector of the headless Service ``namespace/name``; None when there is none."""
        try:
            resp = self.core.read_namespaced_service(name, namespace, _preload_content=False)
        except ApiException:
            return None
        except Exception as err:  # connection trouble: treat as no Service (the pod then does not host)
            log.warning("service %s/%s: read failed (%s)", namespace, name, err)
            return None
        spec = json.loads(resp.data).get("spec") or {}
        return dict(spec.get("selector") or {}) if spec.get("clusterIP") == "None" else None

    def container_env(
        self, pod: dict[str, Any], spec: dict[str, Any], predefined: dict[str, str] | None = None
    ) -> dict[str, str]:
        """The container's env as the kubelet builds it: envFrom, then env in order ($(VAR) sees earlier ones and
        the ``predefined`` Service variables, which are not part of the result unless the manifest sets them)."""
        namespace = pod["metadata"]["namespace"]
        env: dict[str, str] = dict(predefined or {})
        defined: set[str] = set()
        for source in spec.get("envFrom") or []:
            prefix = source.get("prefix") or ""
            for kind, ref_key in (("configmap", "configMapRef"), ("secret", "secretRef")):
                if ref_key in source:
                    ref = source[ref_key]
                    try:
                        data = self._read_source(kind, namespace, ref["name"], bool(ref.get("optional")))
                    except MountError as err:
                        raise ContainerConfigError(str(err)) from err
                    binary_keys = self._binary_keys.get((kind, namespace, ref["name"]), set())
                    for key, raw in (data or {}).items():
                        # Only ``data`` becomes env (the kubelet ignores binaryData); invalid names are skipped.
                        if key in binary_keys or not ENV_NAME_RE.fullmatch(prefix + key):
                            continue
                        env[prefix + key] = raw.decode("utf-8", "replace")
                        defined.add(prefix + key)
        for var in spec.get("env") or []:
            name = var["name"]
            if "valueFrom" in var:
                value = self._value_from(pod, var["valueFrom"])
                if value is None:
                    continue
            else:
                value = expand_vars(var.get("value") or "", env)
            env[name] = value
            defined.add(name)
        return {name: value for name, value in env.items() if name in defined}

    def _value_from(self, pod: dict[str, Any], source: dict[str, Any]) -> str | None:
        namespace = pod["metadata"]["namespace"]
        for kind, ref_key, label in (
            ("configmap", "configMapKeyRef", "ConfigMap"),
            ("secret", "secretKeyRef", "Secret"),
        ):
            if ref_key in source:
                ref = source[ref_key]
                optional = bool(ref.get("optional"))
                try:
                    data = self._read_source(kind, namespace, ref["name"], optional)
                except MountError as err:
                    raise ContainerConfigError(str(err)) from err
                if data is None:
                    return None
                if ref["key"] not in data:
                    if optional:
                        return None
                    raise ContainerConfigError(f"couldn't find key {ref['key']} in {label} {namespace}/{ref['name']}")
                return data[ref["key"]].decode("utf-8", "replace")
        if "fieldRef" in source:
            return field_ref_value(pod, source["fieldRef"]["fieldPath"])
        if "resourceFieldRef" in source:
            return resource_field_value(pod, source["resourceFieldRef"])
        return None

    def container_process_config(self, pod: dict[str, Any], spec: dict[str, Any], pod_dir: Path) -> ProcessConfig:
        """argv, environment, working directory and host termination-message path of one container instance.

        The environment holds only what a container gets on a real node: the image's ENV, ``HOSTNAME``, the
        ``kubernetes`` Service's variables and the manifest's env/envFrom; nothing of this process's own.
        """
        namespace = pod["metadata"]["namespace"]
        services = service_env(self.api_host, self.api_port)
        pod_env = self.container_env(pod, spec, services)
        container_dir = pod_dir / "containers" / spec["name"]
        term_container_path = spec.get("terminationMessagePath") or DEFAULT_TERMINATION_PATH
        term_host_path = pod_dir / "termination" / spec["name"]
        volume_mounts = self.mounts_for(pod, spec, pod_dir)
        mounts = [*volume_mounts, (term_container_path, str(term_host_path))]
        working_dir = spec.get("workingDir") or ""
        if working_dir and is_under_mount(working_dir, volume_mounts):
            cwd = Path(rewrite_path(working_dir, volume_mounts))
        else:
            # A directory of the container's own filesystem, which paths under the working dir map to.
            cwd = container_dir / "workdir"
            if working_dir:
                mounts.append((working_dir, str(cwd)))
        mounts.sort(key=lambda m: len(m[0]), reverse=True)

        def resolve(host: str) -> tuple[str, str] | None:
            return self.resolve_cluster_host(host, namespace)

        raw_args = [*(spec.get("command") or []), *(spec.get("args") or [])]
        # Before any rewrite, while the endpoint still names its host: may this pod host the c10d store?
        endpoint = rdzv_endpoint([expand_vars(a, {**services, **pod_env}) for a in raw_args], pod_env)
        store_host = self.hosts_rdzv_store(pod, endpoint) if endpoint is not None else None
        # Ports first: MASTER_PORT is relative to MASTER_ADDR's (unrewritten) host.
        for addr_var, port_var in (("MASTER_ADDR", "MASTER_PORT"), ("PET_MASTER_ADDR", "PET_MASTER_PORT")):
            target = resolve(pod_env.get(addr_var, ""))
            if target is not None and pod_env.get(port_var, "").isdigit():
                pod_env[port_var] = str(self.ports.get(target[0], target[1], int(pod_env[port_var])))
        for name, value in list(pod_env.items()):
            if name in ("MASTER_PORT", "PET_MASTER_PORT"):
                continue
            value = rewrite_hosts(value, resolve, self.ports.get, bare=bool(BARE_HOST_VAR_RE.search(name)))
            pod_env[name] = rewrite_path_value(value, mounts, split_colons=True)
        expand_env = {**services, **pod_env}
        argv = [
            rewrite_path_value(
                rewrite_hosts(expand_vars(a, expand_env), resolve, self.ports.get, bare=False),
                mounts,
                split_colons=False,
            )
            for a in raw_args
        ]
        if store_host is not None:
            argv, pod_env = with_is_host(argv, pod_env, store_host)
        python = str(self.runner_python)
        argv = python_argv(argv, python) or [python, "-c", "pass"]
        home, tmp = container_dir / "home", container_dir / "tmp"
        # Lowest to highest precedence, as containerd and the kubelet layer them; TMPDIR first: the container's /tmp.
        env = {
            "TMPDIR": str(tmp),
            "HOSTNAME": pod_dns_hostname(pod),
            **image_env(python, str(home)),
            **services,
            **pod_env,
        }
        return ProcessConfig(
            argv=argv, env=env, cwd=cwd, container_dir=container_dir, home=home, tmp=tmp, term_path=term_host_path
        )

    # -- logs -----------------------------------------------------------------------------------------------------

    def log_source(self, namespace: str, pod: str, container: str, previous: bool) -> LogSource | LogError:
        """The log file to serve and a 'still running' probe, or the kubelet's error for this request."""
        with self._lock:
            runner = self._runners.get((namespace, pod))
        if runner is None:
            return LogError(404, f'pod "{pod}" not found')
        c = runner.find_container(container)
        if c is None:
            return LogError(400, f'container "{container}" in pod "{pod}" is not valid')
        if previous:
            if c.runs < 2:
                return LogError(400, f'previous terminated container "{container}" in pod "{pod}" not found')
            return LogSource(runner.log_path(c, c.runs - 2), lambda: False)
        path = runner.log_path(c, c.runs - 1) if c.runs else None
        if path is None or not path.exists():
            reason = c.state.get("waiting", {}).get("reason", "ContainerCreating")
            return LogError(400, f'container "{container}" in pod "{pod}" is waiting to start: {reason}')
        run = c.runs - 1
        return LogSource(path, lambda: c.live and c.runs - 1 == run)

    # -- main loop ------------------------------------------------------------------------------------------------

    def run(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "pgids").touch()
        self.start_log_server()
        while not self.stop.is_set():
            try:
                self.register_node()
                break
            except Exception as err:
                log.warning("node registration failed (%s); retrying", err)
                self.stop.wait(1.0)
        informer = ListWatch("pods", self.core.list_pod_for_all_namespaces, self.on_event, self.on_relist)
        informer.run(self.stop)

    def shutdown(self) -> None:
        self.stop.set()
        with self._lock:
            runners = list(self._runners.values())
        for runner in runners:
            runner.gone()
        for runner in runners:
            runner.finished.wait(MAX_GRACE_SECONDS + 2)


def field_ref_value(pod: dict[str, Any], path: str) -> str:
    meta = pod["metadata"]
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": NODE_NAME,
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
        "status.hostIP": HOST_IP,
        "status.hostIPs": HOST_IP,
        "status.podIP": HOST_IP,
        "status.podIPs": HOST_IP,
    }
    if path in simple:
        return str(simple[path])
    match = re.fullmatch(r"metadata\.(labels|annotations)(?:\['(.+)'\])?", path)
    if match:
        values = meta.get(match.group(1)) or {}
        if match.group(2) is not None:
            return str(values.get(match.group(2), ""))
        return "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
    return ""


def resource_field_value(pod: dict[str, Any], ref: dict[str, Any]) -> str:
    """limits.cpu and friends; with no limit set the kubelet reports the node's allocatable."""
    resource = ref.get("resource", "")
    for c in pod["spec"].get("containers") or []:
        if not ref.get("containerName") or c["name"] == ref["containerName"]:
            kind, _, name = resource.partition(".")
            value = ((c.get("resources") or {}).get(kind) or {}).get(name)
            if value is not None:
                return str(value)
    return str(os.cpu_count() or 1) if resource.endswith("cpu") else str(64 * 1024**3)


def build_api_client(kubeconfig: str) -> client.ApiClient:
    cfg = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    # Pods of one test run start in bursts; several threads talk to the apiserver at once.
    cfg.connection_pool_maxsize = 32
    return client.ApiClient(cfg)


def positive_float(value: str) -> float:
    number = float(value)
    if not number > 0:  # also NaN
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value!r}")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument(
        "--runner-python",
        required=True,
        type=Path,
        help="the runner env's python (scripts/build-runner-env.sh --layer DIR), which runs containers' Pythons",
    )
    parser.add_argument(
        "--restart-backoff-scale",
        type=positive_float,
        default=1.0,
        help="test-only speed-up: multiply the crash-loop backoff waits (10 s doubling to 300 s) and their 10-minute "
        f"reset by this factor; 1 (default) is a real kubelet, the test cluster passes {TEST_RESTART_BACKOFF_SCALE}",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s sim-kubelet %(levelname)s %(message)s"
    )
    kubelet = Kubelet(
        build_api_client(args.kubeconfig),
        args.workdir.resolve(),
        args.runner_python.absolute(),
        restart_backoff_scale=args.restart_backoff_scale,
    )

    def stop_and_exit() -> None:
        kubelet.shutdown()
        os._exit(0)  # the informer thread may sit in a blocking read; the pods are dealt with

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping pods", signum)
        kubelet.stop.set()
        threading.Thread(target=stop_and_exit, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    kubelet.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
