"""Certificates and keys for the local control plane: one CA, the API server's serving
certificate, client certificates per identity (admin, controller-manager, scheduler, one
per node) and the service-account signing key. EC P-256 keys: fast to make, accepted everywhere."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVING_NAMES = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                 "kubernetes.default.svc.cluster.local"]
SERVING_IPS = ["127.0.0.1", "10.96.0.1"]


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _name(cn: str, orgs: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    return x509.Name([*attrs, x509.NameAttribute(NameOID.COMMON_NAME, cn)])


class Pki:
    """A CA in `folder` and the certificates it signs; `issue()` makes one on demand."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.ca = KeyPair(folder / "ca.crt", folder / "ca.key")
        if not (self.ca.cert.exists() and self.ca.key.exists()):
            self._make_ca()
        self._ca_key = serialization.load_pem_private_key(self.ca.key.read_bytes(), None)
        self._ca_cert = x509.load_pem_x509_certificate(self.ca.cert.read_bytes())

    def _make_ca(self) -> None:
        key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(_name("bij-local-ca")).issuer_name(_name("bij-local-ca"))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=3650))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        _write_key(key, self.ca.key)
        self.ca.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, cn: str, orgs: tuple[str, ...] = (), *, server: bool = False,
              ips: tuple[str, ...] = ()) -> KeyPair:
        """A certificate for `cn` (groups `orgs`), client or serving (for SERVING_IPS and `ips`), kept as
        `<name>.crt/.key`."""
        pair = KeyPair(self.folder / f"{name}.crt", self.folder / f"{name}.key")
        if pair.cert.exists() and pair.key.exists():
            return pair
        key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (x509.CertificateBuilder().subject_name(_name(cn, orgs)).issuer_name(self._ca_cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=3650))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if server:
            sans: list[x509.GeneralName] = [x509.DNSName(n) for n in SERVING_NAMES]
            sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in dict.fromkeys([*SERVING_IPS, *ips])]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._ca_key, hashes.SHA256())  # type: ignore[arg-type]
        _write_key(key, pair.key)
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return pair

    def service_account_keys(self) -> tuple[Path, Path]:
        """(private, public): the key that signs service-account tokens, and the one that verifies them."""
        private, public = self.folder / "sa.key", self.folder / "sa.pub"
        if not (private.exists() and public.exists()):
            key = _key()
            _write_key(key, private)
            public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                             serialization.PublicFormat.SubjectPublicKeyInfo))
        return private, public
