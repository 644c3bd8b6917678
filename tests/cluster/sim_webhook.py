"""The training operator's PyTorchJob validating admission webhook, simulated: an HTTPS AdmissionReview v1 server.

Run it as ``python -m tests.cluster.sim_webhook --cert-dir DIR``. At start it generates a CA and a serving
certificate for 127.0.0.1 (``DIR/ca.crt``, ``tls.crt``, ``tls.key``), listens on a free loopback port and writes
``DIR/endpoint.json`` (``{"pid", "port", "url", "ca_file"}``). The control plane then registers
:func:`webhook_configuration` (``register``), as the real operator's manifests and cert-controller do.

What it mirrors (kubeflow/trainer v1.9.4; controller-runtime v0.24.1, which that release uses):

* Name and path from ``manifests/base/webhook/manifests.yaml`` and ``patch.yaml``: the configuration
  ``validator.training-operator.kubeflow.org`` with one webhook ``validator.pytorchjob.training-operator.kubeflow.org``
  at ``/validate-kubeflow-org-v1-pytorchjob``; rules kubeflow.org/v1 ``pytorchjobs`` CREATE and UPDATE (not
  ``pytorchjobs/status``: status writes are never validated); ``failurePolicy: Fail``, ``sideEffects: None``,
  ``admissionReviewVersions: [v1]``. Here the clientConfig is a URL (``https://127.0.0.1:<port>/...``) with the
  generated CA as ``caBundle`` instead of the in-cluster Service.
* The rules: ``validatePyTorchJob`` (``pkg/webhooks/pytorch/pytorchjob_webhook.go:75-160``), implemented by
  :func:`tests.cluster.sim_operator.validate_job` with upstream's messages; the deprecation warning for
  ``elasticPolicy.nProcPerNode`` comes back as an admission warning (a ``Warning: 299`` header on the response).
  UPDATE validates the new object only (``:62-69`` passes it as the old one too).
* The answer: controller-runtime's ``validatorForType.Handle`` (``pkg/webhook/admission/validator_custom.go:96-154``)
  turns the aggregated field errors into ``admission.Denied(err.Error())``, which is ``ValidationResponse(false,
  msg)`` (``response.go:35-83``): ``response.allowed=false``,
  ``response.status={"code": 403, "reason": "Forbidden", "message": msg}``. A panic in the rules (a ``null``
  replica spec) is recovered into ``Errored(500, "panic: ... [recovered]")`` (``webhook.go:155-168``).

What the API server (1.20; ``ValidatingAdmissionWebhook`` is on by default, and the cluster's
``--disable-admission-plugins=ServiceAccount`` leaves it on) answers the client that sent a rejected create or
update: HTTP **403**, a ``Status`` built by ``webhookerrors.ToStatusErr`` (k8s.io/apiserver
``pkg/admission/plugin/webhook/errors/statuserror.go``) from the webhook's status, message prefixed::

    {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
     "message": "admission webhook \\"validator.pytorchjob.training-operator.kubeflow.org\\" denied the request:
                 spec.pytorchReplicaSpecs[Master].replicas: Forbidden: must be 1",
     "reason": "Forbidden", "code": 403}

There is **no** ``details`` member (the webhook sets none, and ToStatusErr adds none); several errors come as
``denied the request: [err1, err2]``. An RBAC denial is also a 403 with reason ``Forbidden``, but its message is
``pytorchjobs.kubeflow.org is forbidden: User "..." cannot create resource "pytorchjobs" in API group
"kubeflow.org" in the namespace "..."`` and it carries ``"details": {"group": "kubeflow.org", "kind": "pytorchjobs"}``.
So: ``details`` absent and the message starting ``admission webhook "`` means a webhook denial. The checked
bodies: ``tests/cluster_tests/test_sim_webhook.py``.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import http.server
import ipaddress
import json
import logging
import os
import signal
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.cluster.sim_operator import WebhookPanic, aggregate_message, validate_job, validation_warnings
from tests.cluster.sim_trainer_webhook import RUNTIME_PLURALS, runtime_path, runtime_ref, validate_trainjob

log = logging.getLogger("sim-webhook")

CONFIGURATION_NAME = "validator.training-operator.kubeflow.org"
WEBHOOK_NAME = "validator.pytorchjob.training-operator.kubeflow.org"
WEBHOOK_PATH = "/validate-kubeflow-org-v1-pytorchjob"
#: Kubeflow Trainer v2's TrainJob webhook, served here too: a 1.20 API server drops the CRD's CEL rules, so this
#: webhook enforces them with the Trainer webhook's own (tests/cluster/sim_trainer_webhook.py).
TRAINJOB_WEBHOOK_NAME = "validator.trainjob.trainer.kubeflow.org"
TRAINJOB_WEBHOOK_PATH = "/validate-trainer-kubeflow-org-v1alpha1-trainjob"
ENDPOINT_FILE = "endpoint.json"
MAX_BODY = 7 * 1024 * 1024  # controller-runtime's limit for an AdmissionReview body

# ----------------------------------------------------------------------------------------------------------------
# The admission decision (pure)
# ----------------------------------------------------------------------------------------------------------------


def allowed(warnings: list[str] | None = None) -> dict[str, Any]:
    """``admission.Allowed("")``."""
    response: dict[str, Any] = {"allowed": True, "status": {"metadata": {}, "code": 200}}
    if warnings:
        response["warnings"] = list(warnings)
    return response


def denied(message: str, warnings: list[str] | None = None) -> dict[str, Any]:
    """``admission.Denied(message)`` = ``ValidationResponse(false, message)``: code 403, reason Forbidden."""
    status: dict[str, Any] = {"metadata": {}, "code": 403, "reason": "Forbidden"}
    if message:
        status["message"] = message
    response: dict[str, Any] = {"allowed": False, "status": status}
    if warnings:
        response["warnings"] = list(warnings)
    return response


def errored(code: int, message: str) -> dict[str, Any]:
    """``admission.Errored(code, err)``."""
    return {"allowed": False, "status": {"metadata": {}, "code": code, "message": message}}


#: Reads a TrainJob's runtime for the webhook: (the runtime, None), (None, the API's error) where it cannot be read.
RuntimeLookup = Callable[[dict[str, Any]], tuple[dict[str, Any] | None, str | None]]


def admission_response(request: dict[str, Any], lookup: RuntimeLookup | None = None) -> dict[str, Any]:
    """The ``response`` (without ``uid``) for one AdmissionReview ``request`` on pytorchjobs or trainjobs; a TrainJob's
    runtime is read with ``lookup`` (without one, only the CEL rules and the runtime kind are checked)."""
    operation = request.get("operation")
    if operation in ("DELETE", "CONNECT"):
        return allowed()
    if operation not in ("CREATE", "UPDATE"):
        return errored(400, f'unknown operation "{operation}"')
    obj = request.get("object")
    if not isinstance(obj, dict):
        return errored(400, "there is no content to decode")
    old = request.get("oldObject") if operation == "UPDATE" else None
    if (request.get("resource") or {}).get("resource") == "trainjobs":
        if lookup is None or runtime_path(obj) is None:
            errors = validate_trainjob(obj, old)
        else:
            runtime, error = lookup(obj)
            errors = validate_trainjob(obj, old, runtime=runtime, runtime_error=error)
        return denied(aggregate_message(errors)) if errors else allowed()
    try:
        errors = validate_job(obj, old)
    except WebhookPanic as err:
        return errored(500, f"panic: {err} [recovered]")
    warnings = validation_warnings(obj)
    if errors:
        return denied(aggregate_message(errors), warnings)
    return allowed(warnings)


def review(body: dict[str, Any], lookup: RuntimeLookup | None = None) -> dict[str, Any]:
    """An AdmissionReview v1 answer to an AdmissionReview v1 request."""
    request = body.get("request") or {}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {"uid": request.get("uid", ""), **admission_response(request, lookup)},
    }


def api_runtime_lookup(kubeconfig: Path) -> RuntimeLookup:
    """Reads runtimes through the API with ``kubeconfig``'s identity, as the Trainer's webhook reads them through
    its manager's client (``client.Get``): a runtime made a moment ago is seen, a deleted one is not."""
    from kubernetes import client, config
    from kubernetes.client.rest import ApiException

    custom = client.CustomObjectsApi(config.new_client_from_config(config_file=str(kubeconfig)))

    def lookup(obj: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
        ref = runtime_ref(obj)  # admission_response asks only for runtime kinds
        group, plural, name = ref["apiGroup"], RUNTIME_PLURALS[ref["kind"]], ref["name"]
        try:
            if plural == "clustertrainingruntimes":
                resp = custom.get_cluster_custom_object(
                    group, "v1alpha1", plural, name, _preload_content=False, _request_timeout=5
                )
            else:
                namespace = (obj.get("metadata") or {}).get("namespace", "")
                resp = custom.get_namespaced_custom_object(
                    group, "v1alpha1", namespace, plural, name, _preload_content=False, _request_timeout=5
                )
        except ApiException as err:
            try:
                message = str(json.loads(err.body or b"{}").get("message") or err.reason)
            except ValueError:
                message = str(err.reason)
            return None, message
        return dict(json.loads(resp.data)), None

    return lookup


def webhook_configuration(url: str, ca_pem: bytes) -> dict[str, Any]:
    """The ValidatingWebhookConfiguration of ``manifests/base/webhook`` with a URL clientConfig."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": CONFIGURATION_NAME},
        "webhooks": [
            {
                "name": WEBHOOK_NAME,
                "admissionReviewVersions": ["v1"],
                "clientConfig": {"url": url, "caBundle": base64.b64encode(ca_pem).decode()},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "rules": [
                    {
                        "apiGroups": ["kubeflow.org"],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["pytorchjobs"],
                    }
                ],
            },
            {
                "name": TRAINJOB_WEBHOOK_NAME,
                "admissionReviewVersions": ["v1"],
                "clientConfig": {
                    "url": url.replace(WEBHOOK_PATH, TRAINJOB_WEBHOOK_PATH),
                    "caBundle": base64.b64encode(ca_pem).decode(),
                },
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "rules": [
                    {
                        "apiGroups": ["trainer.kubeflow.org"],
                        "apiVersions": ["v1alpha1"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["trainjobs"],
                    }
                ],
            },
        ],
    }


# ----------------------------------------------------------------------------------------------------------------
# Certificates
# ----------------------------------------------------------------------------------------------------------------


def generate_certificates(cert_dir: Path) -> tuple[Path, Path, Path]:
    """A fresh CA and a serving certificate for 127.0.0.1/localhost signed by it; returns (ca, cert, key) paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    cert_dir.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    valid = (now - dt.timedelta(minutes=5), now + dt.timedelta(days=30))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sim-webhook-ca")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sim-webhook")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(
            # Go's TLS (the apiserver) checks SANs only, never the CN.
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    ca_file, cert_file, key_file = cert_dir / "ca.crt", cert_dir / "tls.crt", cert_dir / "tls.key"
    ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_file.chmod(0o600)
    return ca_file, cert_file, key_file


# ----------------------------------------------------------------------------------------------------------------
# The server (I/O)
# ----------------------------------------------------------------------------------------------------------------


class Handler(http.server.BaseHTTPRequestHandler):
    server_version = "sim-webhook"
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] not in (WEBHOOK_PATH, TRAINJOB_WEBHOOK_PATH):
            self._send(404, {"message": "not found"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length <= 0 or length > MAX_BODY:
            self._send(200, {"response": errored(400, "request body is empty or too large")})
            return
        raw = self.rfile.read(length)
        content_type = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip()
        if content_type != "application/json":
            self._send(200, {"response": errored(400, f"contentType={content_type}, expected application/json")})
            return
        try:
            body = json.loads(raw)
        except ValueError as err:
            self._send(200, {"response": errored(400, f"couldn't decode the AdmissionReview: {err}")})
            return
        answer = review(body, getattr(self.server, "runtime_lookup", None))
        request = body.get("request") or {}
        response = answer["response"]
        log.info(
            "%s %s/%s: %s%s",
            request.get("operation"),
            request.get("namespace", ""),
            request.get("name") or ((request.get("object") or {}).get("metadata") or {}).get("name", ""),
            "allowed" if response["allowed"] else "denied",
            "" if response["allowed"] else f" ({response['status'].get('message', '')})",
        )
        self._send(200, answer)

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


class WebhookServer:
    """The HTTPS server on 127.0.0.1; ``port`` 0 picks a free one."""

    def __init__(self, cert_dir: Path, port: int = 0, runtime_lookup: RuntimeLookup | None = None) -> None:
        self.cert_dir = Path(cert_dir)
        self.ca_file, cert_file, key_file = generate_certificates(self.cert_dir)
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.httpd.runtime_lookup = runtime_lookup  # type: ignore[attr-defined]  # read by Handler
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(str(cert_file), str(key_file))
        # The handshake happens on the first read, in the connection's own thread, not in the accept loop.
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.port = int(self.httpd.server_address[1])
        self.url = f"https://127.0.0.1:{self.port}{WEBHOOK_PATH}"

    def write_endpoint(self) -> Path:
        path = self.cert_dir / ENDPOINT_FILE
        tmp = path.with_suffix(".tmp")
        payload = {"pid": os.getpid(), "port": self.port, "url": self.url, "ca_file": str(self.ca_file)}
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
        tmp.replace(path)
        return path

    def serve(self) -> None:
        self.httpd.serve_forever(poll_interval=0.5)

    def start(self) -> WebhookServer:
        """Serve from a background thread (tests)."""
        threading.Thread(target=self.serve, name="sim-webhook", daemon=True).start()
        return self

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# ----------------------------------------------------------------------------------------------------------------
# Registration (called by the control plane, in its own process)
# ----------------------------------------------------------------------------------------------------------------


def read_endpoint(cert_dir: Path, pid: int) -> dict[str, Any] | None:
    """``endpoint.json`` if the webhook process ``pid`` wrote it (a stale one of an earlier run is ignored)."""
    try:
        data = json.loads((Path(cert_dir) / ENDPOINT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("pid") == pid else None


def _api_request(
    api_url: str, token: str, tls: ssl.SSLContext, method: str, path: str, body: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """One API call; returns (HTTP status, decoded body, headers) for success and error answers alike."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        api_url + path,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json", "Accept": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10, context=tls) as resp:
            return resp.status, json.loads(resp.read() or b"{}"), dict(resp.headers)
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            decoded = json.loads(raw or b"{}")
        except ValueError:
            decoded = {"raw": raw.decode(errors="replace")}
        return err.code, decoded, dict(err.headers)


def probe_job(namespace: str) -> dict[str, Any]:
    """A PyTorchJob the schema accepts and the webhook rejects (the Master's ``replicas`` left unset)."""
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "sim-webhook-probe", "namespace": namespace},
        "spec": {
            "pytorchReplicaSpecs": {
                "Master": {"template": {"spec": {"containers": [{"name": "pytorch", "image": "probe"}]}}}
            }
        },
    }


def register(
    api_url: str,
    admin_token: str,
    api_ca_file: Path,
    namespace: str,
    cert_dir: Path,
    pid: int,
    *,
    timeout: float = 30.0,
    check: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Wait for the webhook process ``pid`` to serve, create its ValidatingWebhookConfiguration, then wait until
    the API server calls it (a dry-run create of :func:`probe_job` is denied by it). Returns that denial's body."""
    from tests.cluster.control_plane import ClusterError

    deadline = time.monotonic() + timeout
    endpoint = None
    while endpoint is None:
        if check is not None:
            check()
        endpoint = read_endpoint(cert_dir, pid)
        if endpoint is None:
            if time.monotonic() > deadline:
                raise ClusterError(f"sim-webhook wrote no {cert_dir / ENDPOINT_FILE} within {timeout:.0f}s")
            time.sleep(0.1)
    tls = ssl.create_default_context(cafile=str(api_ca_file))
    configuration = webhook_configuration(endpoint["url"], Path(endpoint["ca_file"]).read_bytes())
    code, body, _ = _api_request(
        api_url,
        admin_token,
        tls,
        "POST",
        "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations",
        configuration,
    )
    if code != 201:
        raise ClusterError(f"creating ValidatingWebhookConfiguration {CONFIGURATION_NAME} failed ({code}): {body}")
    probe_path = f"/apis/kubeflow.org/v1/namespaces/{namespace}/pytorchjobs?dryRun=All"
    last: tuple[int, dict[str, Any]] = (0, {})
    while True:
        if check is not None:
            check()
        code, body, _ = _api_request(api_url, admin_token, tls, "POST", probe_path, probe_job(namespace))
        if code == 403 and WEBHOOK_NAME in str(body.get("message", "")):
            return body
        last = (code, body)
        if time.monotonic() > deadline:
            raise ClusterError(
                f"the API server does not call the PyTorchJob webhook at {endpoint['url']} within {timeout:.0f}s "
                f"(is ValidatingAdmissionWebhook enabled?); a dry-run create of an invalid job got {last}"
            )
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cert-dir", required=True, type=Path)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--kubeconfig", type=Path, default=None, help="read TrainJobs' runtimes with this identity (upstream does)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s sim-webhook %(levelname)s %(message)s"
    )
    lookup = api_runtime_lookup(args.kubeconfig) if args.kubeconfig is not None else None
    server = WebhookServer(args.cert_dir, args.port, runtime_lookup=lookup)

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        threading.Thread(target=server.httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.write_endpoint()
    log.info("serving %s (CA %s)", server.url, server.ca_file)
    server.serve()
    server.httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
