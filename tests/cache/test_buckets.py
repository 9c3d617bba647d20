"""Aspect-ratio buckets: the bucket table, choosing a bucket + crop for an image, and SDXL micro-conditioning."""

from __future__ import annotations

import math

import pytest

from sdxl_trainer.cache.buckets import (
    Bucket,
    CropPlan,
    buckets_for_category,
    categories,
    crop_into,
    micro_conditioning,
    nearest_aspect_bucket,
    plan_crop,
    validate_resolution,
)

ALL_CATEGORIES = list(range(256, 2048 + 1, 64))


def sizes(category: int) -> list[tuple[int, int]]:
    return [(b.width, b.height) for b in buckets_for_category(category)]


def grid_of_images() -> list[tuple[int, int]]:
    """(width, height) pairs covering small/large images and aspects from 1:3 to 3:1."""
    shorts = [200, 300, 448, 511, 512, 513, 600, 777, 1000, 1024, 1500, 2048, 3001]
    aspects = [1 / 3, 1 / 2, 9 / 16, 2 / 3, 3 / 4, 1.0, 4 / 3, 3 / 2, 16 / 9, 2.0, 3.0]
    images = []
    for short in shorts:
        for aspect in aspects:
            if aspect >= 1:
                images.append((round(short * aspect), short))
            else:
                images.append((short, round(short / aspect)))
    return images


# --- the bucket table -------------------------------------------------------------------------------------


@pytest.mark.parametrize("category", ALL_CATEGORIES)
def test_every_bucket_obeys_the_table_rules(category):
    buckets = buckets_for_category(category)
    assert buckets, "every category has buckets"
    for bucket in buckets:
        assert bucket.width % 64 == 0 and bucket.height % 64 == 0, bucket
        assert bucket.width * bucket.height <= category * category, bucket
        assert 0.5 <= bucket.width / bucket.height <= 2.0, bucket
        # The short side is the largest 64-multiple the area allows for the long side ("as close to R x R
        # as possible"), in both orientations.
        long_side, short_side = max(bucket.width, bucket.height), min(bucket.width, bucket.height)
        assert long_side * (short_side + 64) > category * category, bucket
    aspects = [b.aspect for b in buckets]
    assert aspects == sorted(aspects), "sorted tall to wide"
    assert len(set(buckets)) == len(buckets), "no duplicates"
    assert set(sizes(category)) == {(h, w) for w, h in sizes(category)}, "portrait mirrors landscape"
    # The square bucket exists for every category (every category is a multiple of 64).
    assert (category, category) in sizes(category)


def test_category_1024_table_exactly():
    # Hand-checked: for landscape widths 1024..2048, height = floor(1024*1024 / width / 64) * 64, kept when
    # width / height <= 2; e.g. 1216 -> 862.3 -> 832; 1408 -> 744.7 -> 704 (2.0, in); 1472 -> 712.3 -> 704
    # (2.09, out). Portrait buckets are the transposes.
    assert sizes(1024) == [
        (704, 1408),
        (768, 1344),
        (768, 1280),
        (832, 1216),
        (896, 1152),
        (960, 1088),
        (1024, 1024),
        (1088, 960),
        (1152, 896),
        (1216, 832),
        (1280, 768),
        (1344, 768),
        (1408, 704),
    ]


def test_category_512_table_exactly():
    # width 320 -> 819.2 -> 768 (aspect 0.42, out); width 704 -> 372.4 -> 320 (aspect 2.2, out).
    assert sizes(512) == [(384, 640), (448, 576), (512, 512), (576, 448), (640, 384)]


def test_well_known_sdxl_buckets_are_present():
    table = sizes(1024)
    for size in [(1024, 1024), (1216, 832), (832, 1216), (1152, 896), (896, 1152), (1344, 768), (768, 1344)]:
        assert size in table, size


@pytest.mark.parametrize("category", [1024, 2048])
def test_bucket_table_treats_portrait_and_landscape_alike(category):
    table = set(sizes(category))
    assert table == {(h, w) for w, h in table}


@pytest.mark.parametrize("width,height", [(2048, 1024), (1200, 400)])
def test_transposed_image_gets_the_transposed_bucket(width, height):
    # Today: 2048x1024 -> 1408x704 but 1024x2048 -> 768x1344 (cropped);
    #        1200x400 -> 768x384 (category 576) but 400x1200 -> 384x640 (category 512).
    landscape = plan_crop(width, height, 512, 1024)
    portrait = plan_crop(height, width, 512, 1024)
    assert (portrait.bucket.width, portrait.bucket.height) == (landscape.bucket.height, landscape.bucket.width)
    assert portrait.category == landscape.category


def test_bucket_str():
    assert str(Bucket(1216, 832)) == "1216x832"
    assert Bucket(1216, 832).aspect == pytest.approx(1216 / 832)


# --- choosing the bucket and crop -------------------------------------------------------------------------


def test_square_image_at_max_resolution_needs_no_crop():
    plan = plan_crop(1024, 1024, 512, 1024)
    assert plan == CropPlan(bucket=Bucket(1024, 1024), category=1024, resized_width=1024, resized_height=1024, crop_left=0, crop_top=0)


def test_large_landscape_image_is_capped_at_max_resolution():
    # 2304x1536 (3:2): nearest aspect in category 1024 is 1216x832 (1.46); scale = max(1216/2304, 832/1536) = 0.5417
    # -> 1248x832, crop (1248 - 1216) / 2 = 16 px from the left.
    plan = plan_crop(2304, 1536, 512, 1024)
    assert plan.category == 1024
    assert plan.bucket == Bucket(1216, 832)
    assert (plan.resized_width, plan.resized_height) == (1248, 832)
    assert (plan.crop_left, plan.crop_top) == (16, 0)


def test_large_portrait_image_mirrors_the_landscape_case():
    plan = plan_crop(1536, 2304, 512, 1024)
    assert plan.bucket == Bucket(832, 1216)
    assert (plan.resized_width, plan.resized_height) == (832, 1248)
    assert (plan.crop_left, plan.crop_top) == (0, 16)


def test_max_resolution_lowers_the_category():
    plan = plan_crop(2304, 1536, 512, 768)
    assert plan.category == 768
    assert plan.bucket.width * plan.bucket.height <= 768 * 768


def test_medium_image_gets_the_largest_category_that_fits():
    # 900x900 is too small for 1024x1024 .. 960x960 but 896x896 fits.
    plan = plan_crop(900, 900, 512, 1024)
    assert plan.category == 896
    assert plan.bucket == Bucket(896, 896)
    assert (plan.resized_width, plan.resized_height) == (896, 896)


@pytest.mark.parametrize("width,height", [(300, 300), (511, 511), (300, 2000), (2000, 300)])
def test_too_small_image_gets_no_plan(width, height):
    assert plan_crop(width, height, 512, 1024) is None


def test_smallest_fitting_image_gets_min_category():
    plan = plan_crop(512, 512, 512, 1024)
    assert plan.category == 512 and plan.bucket == Bucket(512, 512)


def test_short_side_below_min_resolution_can_still_fit_a_wide_bucket():
    # 400 px high is below 512, but category 512's 640x384 bucket fits (and category 576's 768x384 too).
    plan = plan_crop(1200, 400, 512, 1024)
    assert plan.bucket == Bucket(768, 384) and plan.category == 576


@pytest.mark.parametrize("min_res,max_res", [(512, 1024), (256, 2048), (768, 768)])
def test_plan_over_a_grid_of_images(min_res, max_res):
    cats = categories(min_res, max_res)
    planned = 0
    for width, height in grid_of_images():
        plan = plan_crop(width, height, min_res, max_res)
        if plan is None:
            # Even the smallest category's bucket would need upscaling.
            smallest = nearest_aspect_bucket(width, height, min_res)
            assert smallest.width > width or smallest.height > height, (width, height)
            continue
        planned += 1
        bucket = plan.bucket
        assert plan.category in cats
        assert bucket in buckets_for_category(plan.category)
        # Downscale only: the bucket fits inside the image, and so does the resized image.
        assert bucket.width <= width and bucket.height <= height, (width, height, plan)
        assert plan.resized_width <= width and plan.resized_height <= height, (width, height, plan)
        # The resized image covers the bucket, one side exactly (scale to cover, not more).
        assert plan.resized_width >= bucket.width and plan.resized_height >= bucket.height
        assert plan.resized_width == bucket.width or plan.resized_height == bucket.height
        # The aspect ratio is kept up to rounding.
        scale = max(bucket.width / width, bucket.height / height)
        assert abs(plan.resized_width - width * scale) <= 1 and abs(plan.resized_height - height * scale) <= 1
        # Centred crop.
        assert plan.crop_left == (plan.resized_width - bucket.width) // 2
        assert plan.crop_top == (plan.resized_height - bucket.height) // 2
        # Nearest aspect within its category (log space).
        distance = abs(math.log(bucket.aspect) - math.log(width / height))
        assert all(distance <= abs(math.log(b.aspect) - math.log(width / height)) + 1e-12 for b in buckets_for_category(plan.category))
        # Largest category: no larger allowed category's nearest bucket fits.
        for larger in cats[cats.index(plan.category) + 1 :]:
            candidate = nearest_aspect_bucket(width, height, larger)
            assert candidate.width > width or candidate.height > height, (width, height, larger)
    assert planned > 30  # the grid really exercises the planned path


@pytest.mark.parametrize("width,height,expected", [(3000, 1000, Bucket(1408, 704)), (1000, 3000, Bucket(704, 1408))])
def test_extreme_aspects_use_the_most_extreme_bucket(width, height, expected):
    plan = plan_crop(width, height, 512, 1024)
    assert plan.bucket == expected


# --- crop arithmetic -------------------------------------------------------------------------------------


def test_crop_into_hand_computed():
    # 1001x500 into 640x384: scale = max(640/1001, 384/500) = 0.768 -> 768.768 rounds to 769 x 384;
    # crop_left = (769 - 640) // 2 = 64, crop_top = 0.
    plan = crop_into(1001, 500, Bucket(640, 384), 512)
    assert plan == CropPlan(bucket=Bucket(640, 384), category=512, resized_width=769, resized_height=384, crop_left=64, crop_top=0)


def test_crop_into_vertical_crop():
    # 1000x1500 into 832x1216: scale = max(0.832, 0.8107) = 0.832 -> 832 x 1248, crop 16 px from the top.
    plan = crop_into(1000, 1500, Bucket(832, 1216), 1024)
    assert (plan.resized_width, plan.resized_height, plan.crop_left, plan.crop_top) == (832, 1248, 0, 16)


def test_crop_into_exact_fit():
    plan = crop_into(2816, 1408, Bucket(1408, 704), 1024)
    assert (plan.resized_width, plan.resized_height, plan.crop_left, plan.crop_top) == (1408, 704, 0, 0)


# --- micro-conditioning -----------------------------------------------------------------------------------


def test_micro_conditioning_order():
    plan = plan_crop(2304, 1536, 512, 1024)
    # original (h, w), crop (top, left), target (h, w)
    assert micro_conditioning(2304, 1536, plan) == (1536, 2304, 0, 16, 832, 1216)


def test_micro_conditioning_portrait():
    plan = plan_crop(1536, 2304, 512, 1024)
    assert micro_conditioning(1536, 2304, plan) == (2304, 1536, 16, 0, 1216, 832)


# --- resolution validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [500, 192, 2112, 0, 1000])
def test_validate_resolution_rejects(value):
    with pytest.raises(ValueError) as info:
        validate_resolution(value, "--max_resolution")
    message = str(info.value)
    assert f"--max_resolution={value}" in message
    assert "multiple of 64" in message and "256" in message and "2048" in message


@pytest.mark.parametrize("value", [256, 512, 1024, 2048])
def test_validate_resolution_accepts(value):
    validate_resolution(value, "--min_resolution")  # must not raise
    assert value in categories(256, 2048)


def test_categories_range():
    assert categories(512, 1024) == [512, 576, 640, 704, 768, 832, 896, 960, 1024]
    assert categories(768, 768) == [768]


def test_categories_min_above_max():
    with pytest.raises(ValueError, match=r"--min_resolution 1024 is above --max_resolution 512"):
        categories(1024, 512)


def test_categories_names_the_bad_flag():
    with pytest.raises(ValueError, match=r"--min_resolution=500"):
        categories(500, 1024)
    with pytest.raises(ValueError, match=r"--max_resolution=1030"):
        categories(512, 1030)


def test_plan_crop_with_invalid_resolution_raises():
    with pytest.raises(ValueError):
        plan_crop(1024, 1024, 500, 1024)


def test_buckets_for_invalid_category_raises():
    with pytest.raises(ValueError, match="category=500"):
        buckets_for_category(500)
