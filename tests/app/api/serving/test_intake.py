"""The intake stage (app/api/serving/intake.py): each image's header judged in place, and a body's
fields turned into a checked PredictCall, before anything of the request reaches Redis."""

from __future__ import annotations

import pytest

from app.api.serving.intake import PredictCall, check_image
from app.api.serving.multipart import PredictForm
from core.defaults import MAX_TOP_K, TOP_K
from core.errors import InvalidInput, TooLarge, UnsupportedMedia
from tests.app.api.serving.support import image as _image


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP", "GIF"])
def test_accepted_formats_pass_the_header_check(fmt: str) -> None:
    check_image(*_image(fmt), max_pixels=100)


def test_header_check_refusals() -> None:
    with pytest.raises(UnsupportedMedia):
        check_image("a.txt", b"hello", 100)
    with pytest.raises(UnsupportedMedia):
        check_image("empty.png", b"", 100)
    with pytest.raises(UnsupportedMedia):
        check_image(*_image("TIFF"), 100)
    with pytest.raises(TooLarge, match="TORCHYARD_MAX_IMAGE_PIXELS"):
        check_image(*_image(size=(20, 20)), max_pixels=100)




def _form(images: int = 1, **fields: str) -> PredictForm:
    return PredictForm(bytearray(b"x" * images), dict(fields), [("a.png", i, 1) for i in range(images)])


def test_a_call_names_one_job_or_one_alias_and_a_top_k_in_range() -> None:
    call = PredictCall.from_form(_form(job_id="job-1"))
    assert (call.job_id, call.alias, call.top_k) == ("job-1", None, TOP_K)
    call = PredictCall.from_form(_form(alias="pets", top_k=str(MAX_TOP_K)))
    assert (call.job_id, call.alias, call.top_k) == (None, "pets", MAX_TOP_K)
    for fields in ({}, {"job_id": "job-1", "alias": "pets"}, {"job_id": "", "alias": ""}):
        with pytest.raises(InvalidInput, match="exactly one of"):
            PredictCall.from_form(_form(**fields))
    for top_k in ("0", str(MAX_TOP_K + 1), "five", "1.5"):
        with pytest.raises(InvalidInput, match="top_k"):
            PredictCall.from_form(_form(job_id="job-1", top_k=top_k))
    with pytest.raises(InvalidInput):
        PredictCall.from_form(_form(job_id="../etc"))  # ids are validated as the store's are
    with pytest.raises(InvalidInput, match="at least one image"):
        PredictCall.from_form(_form(images=0, job_id="job-1"))
