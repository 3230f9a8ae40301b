"""Code package routes: upload a project's zip (content-addressed), read what is stored."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Request, Response, status
from fastapi.concurrency import run_in_threadpool

from controller import packages as service
from controller.api.deps import SettingsDep
from controller.schemas import PackagePublic

router = APIRouter(prefix="/packages", tags=["packages"])

ZIP_TYPES = frozenset({"application/zip", "application/x-zip-compressed"})
Sha256 = Annotated[str, Path(pattern=r"^[0-9a-f]{64}$", description="The package's SHA-256, hex.")]


def _public(info: service.PackageInfo, created: bool) -> PackagePublic:
    return PackagePublic(ref=info.ref, sha256=info.sha256, size=info.size, files=info.files,
                         unzipped_bytes=info.unzipped_bytes, created=created)


@router.post("", status_code=status.HTTP_201_CREATED, response_model=PackagePublic,
             responses={200: {"model": PackagePublic, "description": "Already stored (the same bytes)."}})
async def upload_package(request: Request, response: Response, settings: SettingsDep) -> PackagePublic:
    """Store a code package: the zip as the body (``Content-Type: application/zip``). 201 when stored
    now, 200 when the same bytes were already; 415 for another type, 413 over the size limit, 422 for
    a package that breaks a rule (named in ``detail``); nothing is stored on any refusal."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in ZIP_TYPES:
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
                            detail=f"Content-Type must be application/zip, got {ctype or 'none'!r}")
    data = await request.body()
    try:
        info, created = await run_in_threadpool(  # unzipping to check it is CPU work: off the event loop
            service.store_package, data, settings.resolved_packages_dir(), max_bytes=settings.max_package_bytes,
            max_unzipped_bytes=settings.max_package_unzipped_bytes, max_files=settings.max_package_files,
        )
    except service.PackageError as e:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=str(e)) from None
    if not created:
        response.status_code = status.HTTP_200_OK
    return _public(info, created)


@router.get("/{sha256}", response_model=PackagePublic)
def get_package(sha256: Sha256, settings: SettingsDep) -> PackagePublic:
    try:
        return _public(service.read_info(settings.resolved_packages_dir(), sha256), False)
    except FileNotFoundError:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no package sha256:{sha256}") from None
