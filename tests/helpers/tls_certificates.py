"""A test CA and the certificates it issues, written as PEM files, for servers on HTTPS.

    ca = CertificateAuthority.create(tmp_path / "ca")
    server_cert = ca.issue(tmp_path / "server", "127.0.0.1", is_server=True)  # .certfile, .keyfile
    client = ca.client_context(ca.issue(tmp_path / "client", "a client", is_server=False))
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=1)


@dataclass(frozen=True)
class IssuedCert:
    certfile: Path
    keyfile: Path


@dataclass(frozen=True)
class CertificateAuthority:
    certfile: Path
    certificate: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(cls, directory: Path, name: str = "pagedserve test CA") -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        certificate = (_builder(subject, subject, key.public_key())
                       .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                       .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                    content_commitment=False, key_encipherment=False,
                                                    data_encipherment=False, key_agreement=False,
                                                    encipher_only=False, decipher_only=False), critical=True)
                       .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                       .sign(key, hashes.SHA256()))
        certfile = _write(directory, certificate, key).certfile
        return cls(certfile, certificate, key)

    def issue(self, directory: Path, name: str, *, is_server: bool) -> IssuedCert:
        """A certificate for a server at the IP address `name`, or for a client called `name`."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        usage = ExtendedKeyUsageOID.SERVER_AUTH if is_server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (_builder(subject, self.certificate.subject, key.public_key())
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                                  critical=False))
        if is_server:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(name))]),
                                            critical=False)
        return _write(directory, builder.sign(self.key, hashes.SHA256()), key)

    def client_context(self, client_cert: IssuedCert | None = None) -> ssl.SSLContext:
        """What a client that trusts this CA (and shows `client_cert`, when given) connects with."""
        context = ssl.create_default_context(cafile=str(self.certfile))
        if client_cert is not None:
            context.load_cert_chain(client_cert.certfile, client_cert.keyfile)
        return context


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY))


def _write(directory: Path, certificate: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> IssuedCert:
    directory.mkdir(parents=True, exist_ok=True)
    certfile, keyfile = directory / "cert.pem", directory / "key.pem"
    certfile.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return IssuedCert(certfile, keyfile)
