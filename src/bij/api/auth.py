"""Who calls `bij-api`, and whether they may: no key is stored anywhere.

The bearer token is a Kubernetes service-account token. TokenReview says whose it is
(``system:serviceaccount:<namespace>:<name>``); that namespace is where the caller's files and
batches live. SubjectAccessReview says whether that identity may create batchinferencejobs
there: a batch is a bij made on the caller's behalf, so the same RBAC decides both. Verdicts are
kept for `ttl` seconds (by the token's sha256, never the token), so polling costs no API calls; a
refusal is asked again each time.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Any

from bij.api.errors import Forbidden, Unauthenticated
from bij.contract.codes import API_GROUP, PLURAL

SA_PREFIX = "system:serviceaccount:"
__all__ = ["Authorizer", "Caller", "Forbidden", "Unauthenticated"]


@dataclass(frozen=True)
class Caller:
    user: str
    namespace: str


class Authorizer:
    """TokenReview + SubjectAccessReview through the API server, with a short cache of verdicts."""

    def __init__(self, api: Any, ttl: float = 30.0, group: str = API_GROUP,
                 resource: str = PLURAL):
        import kubernetes

        self.authn = kubernetes.client.AuthenticationV1Api(api)
        self.authz = kubernetes.client.AuthorizationV1Api(api)
        self.ttl = ttl
        self.group, self.resource = group, resource
        self._cache: dict[str, tuple[float, Caller | Exception]] = {}
        self._lock = threading.Lock()

    def caller(self, header: str | None) -> Caller:
        """The caller of a request with this Authorization header; Unauthenticated or Forbidden."""
        scheme, _, token = (header or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("no bearer token: send a Kubernetes service-account token as the API key")
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            verdict = hit[1]
        else:
            verdict = self._review(token)
            if isinstance(verdict, Caller):  # refusals are not kept: a grant takes effect at once
                with self._lock:
                    if len(self._cache) > 10_000:
                        self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
                    self._cache[key] = (now + self.ttl, verdict)
        if isinstance(verdict, Exception):
            raise verdict
        return verdict

    def _review(self, token: str) -> Caller | Exception:
        review = self.authn.create_token_review({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                                                 "spec": {"token": token}})
        st = review.status
        if st is None or not st.authenticated or st.user is None:
            why = f": {st.error}" if st is not None and st.error else ""
            return Unauthenticated(f"the token was not accepted by the Kubernetes API server{why}")
        user = st.user.username or ""
        if not user.startswith(SA_PREFIX) or user.count(":") != 3:
            return Forbidden(f"{user} is not a service account: use a service-account token, whose namespace "
                             "holds the batches and files")
        namespace = user.split(":")[2]
        sar = self.authz.create_subject_access_review({
            "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {"user": user, "groups": st.user.groups or [], "uid": st.user.uid,
                     "extra": {k: list(v) for k, v in (st.user.extra or {}).items()},
                     "resourceAttributes": {"namespace": namespace, "verb": "create", "group": self.group,
                                            "resource": self.resource}}})
        if not (sar.status and sar.status.allowed):
            return Forbidden(f"{user} may not create {self.resource}.{self.group} in namespace {namespace}: "
                             "grant it that (a Role and RoleBinding) to use batches")
        return Caller(user=user, namespace=namespace)
