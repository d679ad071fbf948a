"""Vision-language models under sequence parallelism (:mod:`arctic.hf.vlm`): Qwen2.5-VL, Qwen3-VL
(M-RoPE, deepstack) and Gemma3 built from tiny configs, images as random pixel tensors, two
rows of 48 tokens whose images the cut splits at image boundaries and mid-image. Loss and
gradients (the vision tower's included) of one SP step against the unmodified model on one
process; each rank encodes exactly the images its piece has tokens of; what is refused."""

from __future__ import annotations

import pytest
import torch

import dist_pool
import launch_pool
from helpers import TOL, get_mesh, value_error_of

pytest.importorskip("transformers", reason="arctic needs transformers ([hf])")
pytestmark = pytest.mark.hf_facing

S, VOCAB, IMAGE = 48, 128, 120
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, pad_token_id=0)
QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                   out_hidden_size=64, patch_size=2, temporal_patch_size=2, spatial_merge_size=2)
PATCH = 3 * 2 * 2 * 2  # channels x temporal patch x patch x patch: a pixel_values row (Qwen)
# (row, first token, grid t/h/w): 4, 8 and 16 tokens (merge 2), each between its start and end
# tokens. At 24 tokens per rank (SP=2) and 12 (SP=4): A and B end at a boundary; D is cut
# inside (both SPs), C at 36 (SP=4).
QWEN_IMAGES = [(0, 8, (1, 4, 4)), (0, 16, (1, 4, 8)), (0, 26, (1, 8, 8)), (1, 20, (1, 8, 8))]
# Gemma3: 4 tokens per image. B is cut at 24 (both SPs), D at 12 (SP=4); E starts at 24.
GEMMA_IMAGES = [(0, 8), (0, 22), (0, 36), (1, 10), (1, 24)]
FIRST_HALF = [(0, 8), (1, 10)]  # at SP=2, rank 1's piece has no image token
VIDEO, VIDEO_GRID = 121, (2, 4, 8)  # a video of 2 frames of 8 tokens each, in row 1
VIDEO_FRAMES = {  # first token of each frame: the cut falls inside the video (SP=2 and 4)
    "qwen2_5_vl": (20, 28),  # one run of tokens, as its processor gives a video
    "qwen3_vl": (20, 31),    # frame by frame (its processor puts time stamps between them)
}


def _model(family: str):
    import transformers as tf

    torch.manual_seed(0)
    ids = dict(image_token_id=IMAGE, video_token_id=121, vision_start_token_id=122,
               vision_end_token_id=123)
    if family == "qwen2_5_vl":
        config = tf.Qwen2_5_VLConfig(
            text_config=dict(**TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
            vision_config=dict(**QWEN_VISION, in_chans=3, window_size=8,
                               fullatt_block_indexes=[1]), **ids)
        return tf.Qwen2_5_VLForConditionalGeneration(config)
    if family == "qwen3_vl":
        rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}
        config = tf.Qwen3VLConfig(
            text_config=dict(**TEXT, rope_scaling=rope),
            vision_config=dict(**QWEN_VISION, in_channels=3, num_position_embeddings=64,
                               deepstack_visual_indexes=[0]), **ids)
        return tf.Qwen3VLForConditionalGeneration(config)
    if family == "qwen3_5":  # Qwen3-VL's vision tower before a hybrid text model
        rope = {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True,
                "partial_rotary_factor": 0.5}
        config = tf.Qwen3_5Config(
            text_config=dict(**TEXT, rope_parameters=rope, linear_num_value_heads=4,
                             linear_num_key_heads=2, linear_key_head_dim=8,
                             linear_value_head_dim=8,
                             layer_types=["linear_attention", "full_attention"]),
            vision_config=dict(**QWEN_VISION, in_channels=3, num_position_embeddings=64), **ids)
        return tf.Qwen3_5ForConditionalGeneration(config)
    config = tf.Gemma3Config(
        text_config=dict(**TEXT, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2),
        mm_tokens_per_image=4, image_token_id=IMAGE, boi_token_index=121, eoi_token_index=122)
    return tf.Gemma3ForConditionalGeneration(config)


def _images(family: str, few: bool = False,
            video: bool = False) -> list[tuple[int, int, int]]:
    """(row, first token, tokens) of each image, in the batch's order (``few``: Gemma3's
    :data:`FIRST_HALF`; ``video``: row 1 holds the video instead of its image)."""
    if family == "gemma3":
        return [(r, a, 4) for r, a in (FIRST_HALF if few else GEMMA_IMAGES)]
    return [(r, a, t * h * w // 4) for r, a, (t, h, w) in QWEN_IMAGES if not video or r == 0]


def _batch(family: str, length: int = S, masked: int = 0, variant: str = "",
           few: bool = False) -> dict:
    """Two rows with images (``variant``: ``"packed"``, two documents per row; ``"video"``,
    row 1's image replaced by a video)."""
    packed, video = variant == "packed", variant == "video"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (2, length), generator=g)
    start, end = (121, 122) if family == "gemma3" else (122, 123)
    for r, a, n in _images(family, few, video):
        ids[r, a - 1], ids[r, a:a + n], ids[r, a + n] = start, IMAGE, end
    if video:
        for a in VIDEO_FRAMES[family]:
            ids[1, a - 1], ids[1, a + 8] = start, end
        for a in VIDEO_FRAMES[family]:
            ids[1, a:a + 8] = VIDEO
    batch = {"input_ids": ids, "labels": ids.masked_fill(ids == IMAGE, -100)}
    if family == "gemma3":  # its images attend both ways within themselves
        batch["token_type_ids"] = (ids == IMAGE).long()
        batch["pixel_values"] = torch.randn(len(_images(family, few)), 3, 16, 16, generator=g)
    else:
        grid = torch.tensor([thw for r, _, thw in QWEN_IMAGES if not video or r == 0])
        batch["pixel_values"] = torch.randn(int(grid.prod(-1).sum()), PATCH, generator=g)
        batch["image_grid_thw"] = grid
        batch["mm_token_type_ids"] = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
        if video:
            frames = torch.tensor([VIDEO_GRID])
            batch["pixel_values_videos"] = torch.randn(int(frames.prod()), PATCH, generator=g)
            batch["video_grid_thw"] = frames
            if family == "qwen2_5_vl":  # its temporal positions are spaced by these
                batch["second_per_grid_ts"] = torch.tensor([2.0])
    if packed:  # the first token of a document is no label of the one before
        for r, cut in enumerate(PACKED_AT):
            batch["labels"][r, cut] = -100
        batch["position_ids"] = _packed_positions(family, batch) if family != "gemma3" else \
            torch.stack([torch.cat([torch.arange(c), torch.arange(length - c)])
                         for c in PACKED_AT])
    if masked:
        mask = torch.ones(2, length, dtype=torch.long)
        mask[:, -masked:] = 0
        batch["attention_mask"] = mask
        batch["labels"] = batch["labels"].masked_fill(mask == 0, -100)
    return batch


PACKED_AT = (43, 38)  # per row, where its second document starts (after an image's end)


def _packed_positions(family: str, batch: dict):
    """Two documents per row, as a packing collator gives them: M-RoPE positions of each
    document on its own (the model's get_rope_index), text positions restarting at 0 first
    (``[4, B, S]``, transformers' packed format)."""
    model, ids = _model(family), batch["input_ids"]
    images = _images(family)
    grid = batch["image_grid_thw"]
    pos = torch.zeros(4, *ids.shape, dtype=torch.long)
    for r, cut in enumerate(PACKED_AT):
        for a, e in ((0, cut), (cut, ids.shape[1])):
            mine = [i for i, (row, first, _) in enumerate(images) if row == r and a <= first < e]
            sub = ids[r:r + 1, a:e]
            rope, _ = model.model.get_rope_index(sub, mm_token_type_ids=(sub == IMAGE).int(),
                                                 image_grid_thw=grid[mine] if mine else None)
            pos[1:, r, a:e] = rope[:, 0]
            pos[0, r, a:e] = torch.arange(e - a)
    return pos


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(family: str, length: int, masked: int, variant: str = ""):
    model = _model(family)
    # use_cache=False: transformers builds packed documents' masks only without a KV cache
    out = model(**_batch(family, length, masked, variant), use_cache=False)
    out.loss.backward()
    return out.loss.item(), _grads(model)


def _label_piece(labels, mesh):
    """This rank's piece of HF's unshifted labels, padded and cut as the inputs are."""
    from ulysses import shard_sequence
    from ulysses.mesh import mesh_dims

    n = -(-labels.shape[1] // mesh_dims(mesh).seq_len_divisor) * mesh_dims(mesh).seq_len_divisor
    return shard_sequence(torch.nn.functional.pad(labels, (0, n - labels.shape[1]), value=-100),
                          mesh)


def _rank_step(family: str, sp: int, ring: int, length: int, masked: int, variant: str):
    """One step: the model's own forward and loss (``labels=`` pieces; the SP loss stands in
    for HF's), or, for Gemma3, arctic.apply_sp_loss (transformers 5.13's Gemma3 forward
    computes a loss of its own, which is refused)."""
    import torch.distributed as dist

    from arctic import apply_sp_loss, prepare_sp_batch, vision_inputs
    from arctic.hf.attention import apply_sequence_parallel
    from ulysses import flat_mesh

    mesh = get_mesh(sp, sp // ring, ring)
    model = _model(family)
    vision_attention = model.config.vision_config._attn_implementation
    apply_sequence_parallel(model, mesh=mesh)
    full = _batch(family, length, masked, variant)
    batch = prepare_sp_batch(full, mesh, vision=vision_inputs(model))
    if family == "gemma3":
        apply_sp_loss(model, group=flat_mesh(mesh, "sp").get_group(), loss_tiles=2)
        loss = model(**batch)  # the SP loss itself
    else:  # a hybrid's linear layers refuse a cache under SP: use_cache=False
        loss = model(**batch, labels=_label_piece(full["labels"], mesh), use_cache=False).loss
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= sp
    # per modality: the pixel rows this rank encodes, the embedding rows it keeps
    counts = {name: (batch[pixels].shape[0], batch[f"{name}_embed_index"].numel())
              for name, pixels in (("image", "pixel_values"), ("video", "pixel_values_videos"))
              if pixels in batch}
    attention = (model.config.vision_config._attn_implementation, vision_attention,
                 model.config.text_config._attn_implementation)
    return loss.item(), _grads(model), counts, batch["position_ids"].shape, attention


def _rank_positions(sp: int, ring: int, n: int) -> list[int]:
    from ulysses.sharding import seq_split, sp_rank_of

    mesh = get_mesh(sp, sp // ring, ring)
    runs = seq_split(mesh).runs(n, sp_rank_of(mesh))
    return [p for start, size in runs for p in range(start, start + size)]


CASES = {  # id -> (family, sp, ring, length, masked, variant)
    "qwen2_5_vl-sp2": ("qwen2_5_vl", 2, 1, S, 0, ""),
    "qwen2_5_vl-sp4": ("qwen2_5_vl", 4, 1, S, 0, ""),
    "qwen2_5_vl-sp4-ring2-padded": ("qwen2_5_vl", 4, 2, S - 3, 2, ""),
    "qwen2_5_vl-sp2-packed": ("qwen2_5_vl", 2, 1, S, 0, "packed"),
    "qwen2_5_vl-sp4-video": ("qwen2_5_vl", 4, 1, S, 0, "video"),
    "qwen3_vl-sp2": ("qwen3_vl", 2, 1, S, 0, ""),
    "qwen3_vl-sp4": ("qwen3_vl", 4, 1, S, 0, ""),
    "qwen3_vl-sp2-video": ("qwen3_vl", 2, 1, S, 0, "video"),
    "qwen3_5-sp2": ("qwen3_5", 2, 1, S, 0, ""),
    "qwen3_5-sp4": ("qwen3_5", 4, 1, S, 0, ""),
    "gemma3-sp2": ("gemma3", 2, 1, S, 0, ""),
    "gemma3-sp4": ("gemma3", 4, 1, S, 0, ""),
    "gemma3-sp4-packed": ("gemma3", 4, 1, S, 0, "packed"),
}
SLOW = {"qwen3_vl-sp4", "qwen2_5_vl-sp4", "qwen3_5-sp4"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c
                                  for c in CASES])
def test_vlm_matches_single_device(case):
    family, sp, ring, length, masked, variant = CASES[case]
    if family == "qwen3_5":  # its linear layers' forward must be the one SP reaches
        from test_arctic_hybrid_models import _skip_unless_supported

        _skip_unless_supported("qwen3_5")
    ref_loss, ref_grads = _reference(family, length, masked, variant)
    assert any("visual" in n or "vision" in n for n in ref_grads)
    images = _images(family, video=variant == "video")
    results = dist_pool.run(_rank_step, family, sp, ring, length, masked, variant,
                            world_size=sp)
    pieces = dist_pool.run(_rank_positions, sp, ring,
                           -(-length // (2 * sp if ring > 1 else sp)) * (2 * sp if ring > 1
                                                                         else sp),
                           world_size=sp)
    # the cut splits images (or the video) at a boundary and inside one (the layout's own
    # pieces)
    firsts = {piece[0] for piece in pieces} | {piece[-1] + 1 for piece in pieces}
    items = images + ([(1, a, 8) for a in VIDEO_FRAMES[family]] if variant == "video" else [])
    assert any(a in firsts or a + n in firsts for _, a, n in items)
    assert any(any(a < f < a + n for f in firsts) for _, a, n in items)
    for (loss, grads, counts, shape, attention), piece in zip(results, pieces):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
        assert set(grads) == set(ref_grads)
        for n, g in grads.items():
            # Gemma3's projection weight has gradients up to ~125: the tolerance scales with it
            scale = max(1.0, float(ref_grads[n].abs().max()))
            torch.testing.assert_close(g, ref_grads[n], rtol=TOL[torch.float32]["rtol"],
                                       atol=TOL[torch.float32]["atol"] * scale,
                                       msg=lambda m: f"{n}: {m}")
        # each rank encodes exactly the images its piece has tokens of
        encoded, kept = counts["image"]
        mine = [i for i, (r, a, n) in enumerate(images) if set(range(a, a + n)) & set(piece)]
        tokens = sum(len(set(range(a, a + n)) & set(piece)) for r, a, n in images)
        assert kept == tokens
        if family == "gemma3":
            assert encoded == len(mine) or (not mine and encoded == 1)
        else:
            rows = [t * h * w for r, _, (t, h, w) in QWEN_IMAGES
                    if variant != "video" or r == 0]
            assert encoded == sum(rows[i] for i in mine) or (not mine and encoded == min(rows))
        assert len(mine) < len(images)
        if variant == "video":  # one video: every rank encodes it, keeps its piece's frames
            frames = {p for a in VIDEO_FRAMES[family] for p in range(a, a + 8)}
            assert counts["video"] == (2 * 4 * 8, len(frames & set(piece)))
        if family != "gemma3":
            assert tuple(shape)[0] == 4  # text positions, then M-RoPE
        # the vision tower keeps its own attention; the language model runs ours
        assert attention[0] == attention[1] and attention[2] == "ulysses"


def _own_loss_model():
    """A causal LM whose forward computes its cross-entropy itself, not through
    ``self.loss_function``."""
    import transformers as tf

    class OwnLossLM(tf.LlamaForCausalLM):
        def forward(self, input_ids=None, position_ids=None, labels=None):
            out = super().forward(input_ids=input_ids, position_ids=position_ids)
            if labels is not None:
                out.loss = torch.nn.functional.cross_entropy(
                    out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            return out

    torch.manual_seed(0)
    return OwnLossLM(tf.LlamaConfig(**TEXT))


def _rank_refusals():
    import transformers as tf

    from arctic import prepare_sp_batch, remove_sequence_parallel, vision_inputs
    from arctic.hf.attention import apply_sequence_parallel

    mesh = get_mesh(2, 2)
    got = {}

    def refused(name, call):
        got[name] = value_error_of(call)

    qwen = apply_sequence_parallel(_model("qwen2_5_vl"), mesh=mesh)
    vision = vision_inputs(qwen)
    full = _batch("qwen2_5_vl")
    batch = prepare_sp_batch(full, mesh, vision=vision)
    refused("encoder-outputs-data", lambda: prepare_sp_batch(
        {**full, "mm_encoder_outputs": {}}, mesh, vision=vision))
    refused("encoder-outputs-model", lambda: qwen(**batch, mm_encoder_outputs={"image": 1}))
    videos = prepare_sp_batch(_batch("qwen2_5_vl", variant="video"), mesh, vision=vision)
    refused("video-no-index", lambda: qwen(**{k: v for k, v in videos.items()
                                             if k != "video_embed_index"}))
    refused("patches-not-concatenated", lambda: prepare_sp_batch(
        {**full, "pixel_values": full["pixel_values"][None]}, mesh, vision=vision))
    uncut = {k: v for k, v in batch.items() if k != "image_embed_index"}
    refused("no-index", lambda: qwen(**{**uncut, "pixel_values": full["pixel_values"],
                                        "image_grid_thw": full["image_grid_thw"]}))
    refused("no-vision", lambda: prepare_sp_batch(full, mesh))
    refused("not-vision-inputs", lambda: prepare_sp_batch(full, mesh, vision={"x": 1}))
    refused("3-row-positions-2d", lambda: prepare_sp_batch(
        {**full, "position_ids": torch.arange(S).expand(2, S)}, mesh, vision=vision))
    features = qwen.model.get_image_features(full["pixel_values"], full["image_grid_thw"])
    got["stock-outside-forward"] = sum(t.shape[0] for t in features.pooler_output)

    # Gemma3's image blocks are not implemented across a ring
    ring = get_mesh(2, 1, 2)
    gemma = apply_sequence_parallel(_model("gemma3"), mesh=ring)
    g_batch = prepare_sp_batch(_batch("gemma3"), ring, vision=vision_inputs(gemma))
    refused("blocks-on-ring", lambda: gemma(**g_batch))
    refused("token-types-qwen", lambda: prepare_sp_batch(
        {**full, "token_type_ids": full["mm_token_type_ids"]}, mesh, vision=vision))

    llava = tf.LlavaForConditionalGeneration(tf.LlavaConfig(
        text_config=tf.LlamaConfig(**TEXT), image_token_id=IMAGE,
        vision_config=tf.CLIPVisionConfig(image_size=16, patch_size=4, hidden_size=32,
                                          intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2)))
    refused("llava", lambda: apply_sequence_parallel(llava, mesh=mesh))
    got["llava-unchanged"] = llava.config.text_config._attn_implementation

    # a forward that computes its loss itself (5.13's Gemma3ForConditionalGeneration does):
    # labels= would give this rank's loss alone
    own = apply_sequence_parallel(_own_loss_model(), mesh=mesh)
    piece = prepare_sp_batch({"input_ids": full["input_ids"]}, mesh)
    refused("own-loss", lambda: own(input_ids=piece["input_ids"],
                                    position_ids=piece["position_ids"], labels=piece["input_ids"]))
    got["own-loss-logits"] = tuple(own(input_ids=piece["input_ids"],
                                       position_ids=piece["position_ids"]).logits.shape)

    # removed: the stock forward on the full batch gives the unmodified model's loss
    remove_sequence_parallel(qwen)
    got["removed-attention"] = qwen.config.text_config._attn_implementation
    got["removed-loss"] = qwen(**full).loss.item()
    return got


def test_vlm_refusals_and_removal():
    ref = _model("qwen2_5_vl")(**_batch("qwen2_5_vl")).loss.item()
    got = dist_pool.run(_rank_refusals, world_size=2)[0]
    for name, words in {"encoder-outputs-data": "precomputed", "encoder-outputs-model":
                        "precomputed", "video-no-index": "each rank encodes its own videos",
                        "patches-not-concatenated": "concatenated",
                        "no-index": "each rank encodes its own images",
                        "no-vision": "pixel_values", "not-vision-inputs": "vision_inputs",
                        "3-row-positions-2d": "M-RoPE",
                        "blocks-on-ring": "ring", "token-types-qwen": "token_type_ids",
                        "llava": "Qwen2-VL", "own-loss": "not through loss_function"}.items():
        assert words in got[name], (name, got[name])
    assert got["stock-outside-forward"] == sum(n for _, _, n in _images("qwen2_5_vl"))
    assert got["llava-unchanged"] != "ulysses"
    assert got["removed-attention"] != "ulysses"
    assert abs(got["removed-loss"] - ref) <= 1e-5 * abs(ref)


# --- under ZeRO-3 (arctic.initialize) and FSDP2 (arctic.apply_fsdp) ---------------------------

def _reference_few(family: str):
    model = _model(family)
    out = model(**_batch(family, few=True), use_cache=False)
    out.loss.backward()
    return out.loss.item(), _grads(model)


def _only(samples: list) -> dict:
    return samples[0]


def _rank_zero3(family: str):
    from deepspeed.utils import safe_get_full_grad

    import arctic.train.deepspeed
    from arctic import prepare_sp_batch, vision_inputs
    from helpers import init_deepspeed_comm

    init_deepspeed_comm()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 3}, "sequence_parallel_size": 2,
              "ulysses": {"loss_tiles": 2, "activation_checkpointing": True}}
    # the engine's loader cuts the batch (one item: the whole two-row batch)
    engine, _, loader, _ = arctic.train.deepspeed.initialize(
        model=_model(family), config=config, training_data=[_batch(family, few=True)],
        collate_fn=_only)
    batch = next(iter(loader))
    assert torch.equal(batch["input_ids"], prepare_sp_batch(
        _batch(family, few=True), engine.sp_mesh,
        vision=vision_inputs(engine.module))["input_ids"])
    loss = engine(**batch)
    engine.backward(loss)
    return loss.item(), {n: safe_get_full_grad(p).clone()
                         for n, p in engine.module.named_parameters()}, len(batch["pixel_values"])


def _rank_fsdp2(family: str):
    from arctic import apply_fsdp, prepare_sp_batch, vision_inputs
    from arctic.config import SequenceParallelConfig
    from arctic.recipe import apply_sp_recipe

    config = SequenceParallelConfig(sequence_parallel_size=2, loss_tiles=2,
                                    activation_checkpointing=True)
    mesh = config.dims(2).build_mesh("cpu")
    model = _model(family)
    apply_sp_recipe(model, config=config, mesh=mesh, averaged_over_sp=True)
    apply_fsdp(model, mesh=mesh)
    batch = prepare_sp_batch(_batch(family, few=True), mesh, vision=vision_inputs(model))
    loss = model(**batch)
    loss.backward()
    return loss.item(), {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()
                         if p.grad is not None}, len(batch["pixel_values"])


@pytest.mark.parametrize("how", [pytest.param("zero3", marks=pytest.mark.slow), "fsdp2"])
def test_vlm_under_sharding_matches_single_device(how):
    """Gemma3 (image blocks on) with its parameters sharded, layers checkpointed, at SP=2, on
    a batch whose images all lie in rank 0's half: rank 1 encodes the smallest image and
    keeps none of it, so both ranks gather the vision tower's parameters alike."""
    ref_loss, ref_grads = _reference_few("gemma3")
    step = _rank_zero3 if how == "zero3" else _rank_fsdp2
    results = dist_pool.run(step, "gemma3", world_size=2)
    assert [encoded for _, _, encoded in results] == [2, 1]
    for loss, grads, _ in results:
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
        # ZeRO-3 gives zeros for the parameters no forward uses (SigLIP's pooling head)
        unused = {n for n in set(grads) - set(ref_grads) if not grads[n].any()}
        assert set(grads) - unused == set(ref_grads)
        for n, g in grads.items():
            if n in unused:
                continue
            scale = max(1.0, float(ref_grads[n].abs().max()))
            torch.testing.assert_close(g, ref_grads[n], rtol=TOL[torch.float32]["rtol"],
                                       atol=TOL[torch.float32]["atol"] * scale,
                                       msg=lambda m: f"{n}: {m}")


# --- under the HF Trainer (examples/vlm_trainer.py) ------------------------------------------

def _trainer_run(cmd: list[str], out) -> launch_pool.Started:
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    full = [sys.executable, str(repo / "examples" / "vlm_trainer.py")] if cmd[0] == "plain" \
        else [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2",
              str(repo / "examples" / "vlm_trainer.py")]
    args = ["--plain"] if cmd[0] == "plain" else []
    return launch_pool.Started(full + args + cmd[1:] + ["--losses-out", str(out),
                                                        "--output-dir", str(out.parent)],
                               cwd=repo)


@pytest.mark.parametrize("family", ["qwen2_5_vl", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_vlm_under_the_trainer_matches_the_plain_trainer(tmp_path, family):
    """SequenceParallelTrainer (2 ranks, ZeRO-3, tiled MLP and loss, checkpointed layers with
    offload: configs/cpu_trainer.json) on batches of 2 samples with an image each, cut with
    the model's vision inputs, against a plain one-process Trainer: the same loss at each
    step and the same eval loss."""
    import json

    runs = {}
    for name in ("sp", "plain"):
        (tmp_path / name).mkdir()
        out = tmp_path / name / "losses.json"
        runs[name] = (_trainer_run([name, "--model", family], out), out)
    got = {}
    for name, (proc, out) in runs.items():
        try:
            log, _ = proc.communicate(timeout=300)
        finally:
            proc.kill()
        assert proc.returncode == 0, log[-6000:]
        got[name] = json.loads(out.read_text())
    sp, plain = got["sp"], got["plain"]
    assert len(sp["loss"]) == len(plain["loss"]) == 4
    assert sp["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=0)
    assert sp["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5, abs=0)
    assert plain["loss"][-1] < plain["loss"][0]
