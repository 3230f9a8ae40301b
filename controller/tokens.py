"""API tokens: issue, look up, list, revoke. The secret is shown once and stored only as a hash.

A token is ``"vgl_" + secrets.token_urlsafe(32)``: 256 random bits. It is stored as its SHA-256.
A fast, unsalted hash is the right tool here, unlike for passwords: a salt and a slow KDF (bcrypt,
argon2) exist to make guessing *low-entropy* secrets expensive, and nobody can enumerate 2**256
candidates however fast the hash is. A plain digest also lets the database find a token by an
indexed equality lookup, instead of checking a slow hash against every row on every request.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.orm import Session

from controller.models import ApiToken, Job
from vigil.contract.schemas import Role, TokenCreate, TokenCreated, TokenPublic

TOKEN_PREFIX = "vgl_"
HINT_CHARS = 8
LAST_USED_RESOLUTION = timedelta(minutes=1)
"""``last_used_at`` is written at most this often per token: a write on every request would make each
read a write (and serialise readers on SQLite's single writer) to gain a precision nobody needs."""


class TokenNotFound(LookupError):
    pass


class UnknownJob(LookupError):
    """A ``job`` token was asked for a job that does not exist."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's id, role and (for the ``job`` role) the one job it may touch."""

    token_id: str | None
    role: Role | None
    """None: nobody in particular (a public route)."""
    job_id: str | None = None
    name: str = ""
    node_id: str | None = None
    """For an ``agent`` token scoped to one node: that node."""


def new_secret() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """SHA-256 hex of the token (see the module docstring for why not a password hash)."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def _hint(token: str) -> str:
    return token[: len(TOKEN_PREFIX) + HINT_CHARS]


def is_active(tok: ApiToken, now: datetime | None = None) -> bool:
    now = now or datetime.now(UTC)
    return tok.revoked_at is None and (tok.expires_at is None or tok.expires_at > now)


def to_public(tok: ApiToken) -> TokenPublic:
    return TokenPublic(
        id=tok.id, name=tok.name, role=Role(tok.role), job_id=tok.job_id, node_id=tok.node_id, hint=tok.hint,
        created_at=tok.created_at,
        created_by=tok.created_by, expires_at=tok.expires_at, revoked_at=tok.revoked_at,
        last_used_at=tok.last_used_at, active=is_active(tok),
    )


def create_token(session: Session, spec: TokenCreate, created_by: str | None = None) -> TokenCreated:
    """Store a new token (its hash) and return it with its secret, the only time the secret exists.

    Nothing is flushed here: the caller's transaction writes it (the supervisor adds a token and
    then calls Ray, and must not hold SQLite's write lock meanwhile).
    """
    if spec.job_id is not None and session.get(Job, spec.job_id) is None:
        raise UnknownJob(spec.job_id)
    secret = new_secret()
    tok = ApiToken(
        id="tok_" + uuid.uuid4().hex[:16], token_hash=hash_token(secret), hint=_hint(secret), name=spec.name,
        role=spec.role.value, job_id=spec.job_id, node_id=spec.node_id, created_at=datetime.now(UTC), created_by=created_by,
        expires_at=spec.expires_at,
    )
    session.add(tok)
    return TokenCreated(**to_public(tok).model_dump(), token=secret)


_TOKENS = ApiToken.__table__
_BY_HASH = select(*(_TOKENS.c[name] for name in ("id", "role", "job_id", "name", "node_id", "revoked_at", "expires_at",
                                                 "last_used_at"))).where(_TOKENS.c.token_hash == bindparam("token_hash"))
_USED = update(_TOKENS).where(_TOKENS.c.id == bindparam("token_id")).values(last_used_at=bindparam("now"))


def authenticate(session: Session, token: str) -> Principal | None:
    """The principal of an active ``token``, or None (unknown, revoked or expired).

    Records the use (at most once per :data:`LAST_USED_RESOLUTION`); the caller commits.
    """
    if not token.startswith(TOKEN_PREFIX) or len(token) > 256:
        return None
    # A Core statement built once, no ORM object: this runs for every request (telemetry posts included).
    conn = session.connection()
    tok = conn.execute(_BY_HASH, {"token_hash": hash_token(token)}).first()
    now = datetime.now(UTC)
    if tok is None or tok.revoked_at is not None or (tok.expires_at is not None and tok.expires_at <= now):
        return None
    if tok.last_used_at is None or now - tok.last_used_at >= LAST_USED_RESOLUTION:
        conn.execute(_USED, {"token_id": tok.id, "now": now})
    return Principal(token_id=tok.id, role=Role(tok.role), job_id=tok.job_id, name=tok.name, node_id=tok.node_id)


def list_tokens(session: Session, limit: int, offset: int, include_inactive: bool = True) -> tuple[list[ApiToken], int]:
    q = select(ApiToken)
    if not include_inactive:
        now = datetime.now(UTC)
        q = q.where(ApiToken.revoked_at.is_(None), (ApiToken.expires_at.is_(None)) | (ApiToken.expires_at > now))
    count = session.scalar(select(func.count()).select_from(q.subquery())) or 0
    rows = session.scalars(q.order_by(ApiToken.created_at.desc(), ApiToken.id).limit(limit).offset(offset)).all()
    return list(rows), count


def revoke_token(session: Session, token_id: str) -> ApiToken:
    """Revoke a token (idempotent: a revoked token keeps its first revocation time)."""
    tok = session.get(ApiToken, token_id)
    if tok is None:
        raise TokenNotFound(token_id)
    if tok.revoked_at is None:
        tok.revoked_at = datetime.now(UTC)
    return tok


def revoke_job_tokens(session: Session, job_id: str) -> int:
    """Revoke every token scoped to ``job_id``, including ones added in this session but not yet written.

    Runs without autoflush so that a caller's pending writes are not sent early (see create_token).
    """
    now = datetime.now(UTC)
    n = 0
    pending = [o for o in session.new if isinstance(o, ApiToken) and o.job_id == job_id]
    with session.no_autoflush:
        stored = session.scalars(
            select(ApiToken).where(ApiToken.job_id == job_id, ApiToken.revoked_at.is_(None))
        ).all()
    for tok in [*pending, *stored]:
        if tok.revoked_at is None:
            tok.revoked_at = now
            n += 1
    return n
