"""Data layer: LeRobot datasets -> Grain pipeline -> per-process NumPy batches. Imports no model.

Modules (one concept each):

- `lerobot`: `LeRobotDataset(root, *, tolerance_s=1e-4, skip_bad_episodes=False, episodes=None)`
  reads v2.0/v2.1/v3.0. `num_episodes`, `num_frames`, `fps`, `tasks`, `camera_keys`,
  `episode_indices` (dataset ids; episodes are addressed by position 0..num_episodes-1,
  `position_of(episode_index)` maps back), `arrays` (every per-frame numeric column over all
  episodes), `episode_array(position, key)`, `images(position, camera, frames)` -> uint8
  [N, H, W, 3] looked up by timestamp, and `frame(position, frame)` -> dict of every feature
  under its dataset key, cameras uint8 HWC, `task`, `timestamp`, `episode_index`,
  `frame_index`, `index`. Malformed data raises `DatasetError` naming file and episode.
  What `meta/info.json` says and checked reads of the dataset's files: `lerobot_meta`
  (`DatasetMeta`, `DatasetError`); the task and episode tables: `lerobot_episodes`.
- `writer`: `write_lerobot_dataset(root, episodes, *, fps, version, codec, ...)` (v2.1/v3.0,
  AV1/H.264 mp4 or PNG-in-parquet).
- `samples`: `SampleSpec` + `SampleLoader` (action chunks with `<key>_is_pad`, history,
  delta actions), over a `LeRobotDataset` or a `FrameStore` alike.
- `stats`: streaming `compute_stats`, `NormStats` (JSON), `Normalizer` (mean_std/min_max/quantile).
- `transforms`: random crop, rotation, colour jitter, `ImageTransform` (resize-with-pad and
  uint8 -> float [-1, 1] come from `embodied_jax.images`, shared with the input builders).
- `packing`: the one packer of every model: `PackingConfig` (`seq_len` 0 = off), `pack` (a Grain
  dataset of unpadded samples -> rows with `segment_ids`/`positions`, image slots with
  `image_segment_ids`, per-sample values with `sample_mask`), `pack_samples` (a list -> a batch).
- `pipeline`: `DataConfig`, `SourceConfig`, `make_data_iterator(config, *, process_index,
  process_count, batch_size, seed, builder=None, packing=PackingConfig())` -> `DataIterator`
  with JSON `get_state()`/`set_state()`.
- `framestore` / `convert`: TensorStore zarr3 store of pre-resized frames; `python -m embodied_jax.data.convert`.
- `inspect`: `python -m embodied_jax.data.inspect DIR [--episode E --frame F --save OUT.npz]`.
- `modality`: GR00T `meta/modality.json`; `video`: PyAV codecs; `synthetic`: self-identifying test episodes.
"""
