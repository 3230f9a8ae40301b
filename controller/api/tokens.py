"""Token management (admin only, by ROUTE_POLICY): issue, list, revoke; and ``GET /whoami`` (any valid token).

The router has no prefix: ``/whoami`` sits beside ``/tokens`` (the dashboard's sign-in checks a pasted
token with it)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, status

from controller import tokens as service
from controller.api.deps import CurrentPrincipal, SessionDep
from vigil.contract.schemas import ID_PATTERN, TokenCreate, TokenCreated, TokenPublic, TokensPublic, WhoAmI

router = APIRouter(tags=["tokens"])

TokenId = Annotated[str, Path(pattern=ID_PATTERN, description="A token's id (tok_...), not its secret.")]


@router.post("/tokens", status_code=status.HTTP_201_CREATED, response_model=TokenCreated)
def create_token(body: TokenCreate, session: SessionDep, principal: CurrentPrincipal) -> TokenCreated:
    """Issue a token. The answer holds its secret: the only time it is shown (only a hash is kept)."""
    try:
        created = service.create_token(session, body, created_by=principal.token_id)
    except service.UnknownJob:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job {body.job_id!r} not found") from None
    session.commit()  # stored before its secret leaves
    return created


@router.get("/tokens", response_model=TokensPublic)
def list_tokens(
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
    include_inactive: bool = True,
) -> TokensPublic:
    """Tokens, newest first, without their secrets."""
    rows, count = service.list_tokens(session, limit, offset, include_inactive)
    return TokensPublic(data=[service.to_public(t) for t in rows], count=count)


@router.post("/tokens/{token_id}/revoke", response_model=TokenPublic)
def revoke_token(token_id: TokenId, session: SessionDep) -> TokenPublic:
    """Revoke a token at once (idempotent). The record stays, for the audit trail."""
    try:
        return service.to_public(service.revoke_token(session, token_id))
    except service.TokenNotFound:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"token {token_id!r} not found") from None


@router.get("/whoami", response_model=WhoAmI)
def whoami(principal: CurrentPrincipal) -> WhoAmI:
    """The caller's token: id, role, name and scope (job or node), never its secret."""
    if principal.role is None:  # cannot happen: ROUTE_POLICY lets only a valid token here
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, detail="a bearer token is required")
    return WhoAmI(token_id=principal.token_id, role=principal.role, name=principal.name,
                  job_id=principal.job_id, node_id=principal.node_id)
