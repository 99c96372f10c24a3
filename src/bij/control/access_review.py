"""Ask the API server whether a worker identity holds `permissions.WORKER_GRANTS`: one
LocalSubjectAccessReview per grant. Namespaced, so a namespace admin (`bij doctor`) and an operator
installed with Roles only may ask it."""

from __future__ import annotations

from typing import Any

from bij.control.permissions import WORKER_GRANTS, Grant, GrantCheck, service_account_user


def check_grants(authz: Any, namespace: str, sa: str) -> GrantCheck:
    """Ask, as `authz`'s identity (a kubernetes AuthorizationV1Api), whether `sa` of `namespace` holds every
    one of `WORKER_GRANTS`. An API error (the caller may not ask) is an answer too: `cannot_ask`."""
    from kubernetes.client import (
        ApiException,
        V1LocalSubjectAccessReview,
        V1ObjectMeta,
        V1ResourceAttributes,
        V1SubjectAccessReviewSpec,
    )

    user = service_account_user(namespace, sa)
    missing: list[Grant] = []
    for g in WORKER_GRANTS:
        review = V1LocalSubjectAccessReview(metadata=V1ObjectMeta(namespace=namespace), spec=V1SubjectAccessReviewSpec(
            user=user, groups=["system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"],
            resource_attributes=V1ResourceAttributes(namespace=namespace, verb=g.verb, group=g.group,
                                                     resource=g.resource, subresource=g.subresource or None)))
        try:
            answer = authz.create_namespaced_local_subject_access_review(namespace, review)
        except ApiException as e:
            return GrantCheck(namespace, sa, cannot_ask=f"create localsubjectaccessreviews: {e.status} {e.reason}")
        if not answer.status.allowed:
            missing.append(g)
    return GrantCheck(namespace, sa, tuple(missing))
