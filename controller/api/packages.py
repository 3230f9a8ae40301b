"""Code package routes: upload a project's zip (content-addressed), read what is stored."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Request, Response, status
from fastapi.concurrency import run_in_threadpool

from controller import package_store
from controller import packages as service
from controller.api.deps import SettingsDep
from controller.auth import CurrentPrincipal
from controller.db import session_scope, sqlite_writer
from controller.tokens import Principal, Role
from vigil.contract.schemas import PackagePublic
from vigil.contract.settings import Settings

router = APIRouter(prefix="/packages", tags=["packages"])

ZIP_TYPES = frozenset({"application/zip", "application/x-zip-compressed"})
Sha256 = Annotated[str, Path(pattern=r"^[0-9a-f]{64}$", description="The package's SHA-256, hex.")]


def _public(info: service.PackageInfo, created: bool) -> PackagePublic:
    return PackagePublic(ref=info.ref, sha256=info.sha256, size=info.size, files=info.files,
                         unzipped_bytes=info.unzipped_bytes, created=created)


@router.post("", status_code=status.HTTP_201_CREATED, response_model=PackagePublic,
             responses={200: {"model": PackagePublic, "description": "Already stored (the same bytes)."}})
async def upload_package(request: Request, response: Response, settings: SettingsDep,
                         principal: CurrentPrincipal) -> PackagePublic:
    """Store a code package: the zip as the body (``Content-Type: application/zip``). 201 when stored
    now, 200 when the same bytes were already; 415 for another type, 413 over the size limit or over the
    token's package quota, 422 for a package that breaks a rule (named in ``detail``); nothing is stored on
    any refusal. Packages no recent job uses are removed first (controller/package_store.py)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in ZIP_TYPES:
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
                            detail=f"Content-Type must be application/zip, got {ctype or 'none'!r}")
    data = await request.body()
    try:  # unzipping to check it is CPU work, and the database's: off the event loop
        info, created = await run_in_threadpool(_store, request.app.state.sessions, data, settings, principal)
    except service.PackageError as e:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=str(e)) from None
    except package_store.QuotaExceeded as e:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, detail=str(e)) from None
    if not created:
        response.status_code = status.HTTP_200_OK
    return _public(info, created)


def _store(sessions, data: bytes, settings: Settings, principal: Principal):  # type: ignore[no-untyped-def]
    owner = principal.token_id or ""
    quota = None if principal.role in (Role.ADMIN, None) else settings.package_quota_bytes
    folder = settings.resolved_packages_dir()
    with sqlite_writer(sessions), session_scope(sessions) as session:
        package_store.collect(session, folder, settings.package_keep_s)
        info, created = service.store_package(
            data, folder, max_bytes=settings.max_package_bytes, max_unzipped_bytes=settings.max_package_unzipped_bytes,
            max_files=settings.max_package_files,
            admit=lambda i: package_store.check_quota(session, owner, i, quota))
        package_store.claim(session, owner, info)
    return info, created


@router.get("/{sha256}", response_model=PackagePublic)
def get_package(sha256: Sha256, settings: SettingsDep) -> PackagePublic:
    try:
        return _public(service.read_info(settings.resolved_packages_dir(), sha256), False)
    except FileNotFoundError:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no package sha256:{sha256}") from None
