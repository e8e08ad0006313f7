"""MJCF for the built-in tasks, written here from primitive geoms (no asset files).

The robots are Cartesian gantry arms: three prismatic joints (x, y, z) carry a hand
with a two-finger parallel gripper whose fingers slide along y. Joint space *is* the
pinch point's position in the world, so a scripted expert needs no numerical inverse
kinematics, compiles fast on CPU under the MJX JAX backend, and still has real
contact physics for grasping (fingers and objects are the only colliding geoms).

Collision filtering (contype/conaffinity bits) leaves exactly the pairs that matter:
object-floor and object-finger. Arm links, targets and goal markers are visual only.

Every scene has a ``scene`` camera (fixed, looking at the table from the front) and a
``wrist`` camera per arm (``wrist`` for one arm, ``wrist_left``/``wrist_right`` for two).
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Gripper geometry (metres). The finger joint value is the opening of one finger.
FINGER_OPEN = 0.045
FINGER_HALF = (0.012, 0.006, 0.018)
HAND_MIN_Z = 0.02
# Fingers collide through two invisible sphere "pads" (group 3) spread across each
# finger's width: two contact points per finger resist the object pivoting in the grip
# as well as the box face does, at a fraction of MJX's box-box contact cost.
FINGER_PAD_X = 0.009
FINGER_PAD_DEPTH = 0.004

# Cameras: the fixed scene camera looks at the table from the front; each wrist camera
# sits behind and above the pinch point (hand frame) looking forward and down past the fingers.
SCENE_CAMERA = {"pos": (0.0, -0.48, 0.42), "look_at": (0.0, 0.0, 0.03), "fovy": 58}
WRIST_CAMERA = {"pos": (-0.05, 0.0, 0.03), "look_at": (0.02, 0.0, -0.04), "fovy": 85}

TIMESTEP = 0.01
# Actuator force limits (N): bound accelerations when a policy commands large jumps.
ARM_FORCE = 40
FINGER_FORCE = 15


@dataclasses.dataclass(frozen=True)
class ArmSpec:
    """One gantry arm: a name prefix and the box its pinch point can reach."""

    prefix: str
    x_range: tuple[float, float]
    y_range: tuple[float, float] = (-0.25, 0.25)
    z_range: tuple[float, float] = (HAND_MIN_Z, 0.3)
    color: str = "0.55 0.57 0.62 1"
    finger_color: str = "0.95 0.6 0.1 1"
    column_y: float = 0.0


def _camera_axes(position, look_at):
    """MJCF ``xyaxes`` for a camera at ``position`` looking at ``look_at``, image up towards world +z."""
    f = np.subtract(look_at, position, dtype=np.float64)
    f /= np.linalg.norm(f)
    right = np.cross(f, (0.0, 0.0, 1.0))
    if np.linalg.norm(right) < 1e-6:  # looking straight down: image right is world x
        right = np.array([1.0, 0.0, 0.0])
    right /= np.linalg.norm(right)
    up = np.cross(right, f)
    return " ".join(f"{v:.4f}" for v in (*right, *up))


def _vec(values) -> str:
    return " ".join(f"{v:g}" for v in values)


def _arm_xml(arm: ArmSpec, wrist_camera: str) -> str:
    p = arm.prefix
    fx, fy, fz = FINGER_HALF
    pad_x, pad_z = FINGER_PAD_X, FINGER_PAD_DEPTH
    return f"""
    <body name="{p}carriage_x" pos="0 0 0" gravcomp="1">
      <inertial pos="0 0 0" mass="0.3" diaginertia="1e-3 1e-3 1e-3"/>
      <joint name="{p}x" type="slide" axis="1 0 0" range="{arm.x_range[0]} {arm.x_range[1]}" damping="40"/>
      <geom name="{p}rail" type="box" pos="0 {arm.column_y} 0.42" size="0.02 0.3 0.015" rgba="{arm.color}"
          contype="0" conaffinity="0"/>
      <body name="{p}carriage_y" gravcomp="1">
        <inertial pos="0 0 0" mass="0.2" diaginertia="1e-3 1e-3 1e-3"/>
        <joint name="{p}y" type="slide" axis="0 1 0" range="{arm.y_range[0]} {arm.y_range[1]}" damping="35"/>
        <body name="{p}hand" gravcomp="1">
          <inertial pos="0 0 0" mass="0.2" diaginertia="1e-3 1e-3 1e-3"/>
          <joint name="{p}z" type="slide" axis="0 0 1" range="{arm.z_range[0]} {arm.z_range[1]}" damping="30"/>
          <geom name="{p}palm" type="box" pos="0 0 0.035" size="0.02 0.055 0.012" rgba="{arm.color}" contype="0"
              conaffinity="0"/>
          <geom name="{p}column" type="box" pos="0 0 0.2" size="0.012 0.012 0.16" rgba="{arm.color}" contype="0"
              conaffinity="0"/>
          <site name="{p}pinch" pos="0 0 0" size="0.005"/>
          <camera name="{wrist_camera}" pos="{_vec(WRIST_CAMERA["pos"])}"
              xyaxes="{_camera_axes(WRIST_CAMERA["pos"], WRIST_CAMERA["look_at"])}" fovy="{WRIST_CAMERA["fovy"]}"/>
          <body name="{p}finger_a" gravcomp="1">
            <inertial pos="0 0 0" mass="0.1" diaginertia="1e-4 1e-4 1e-4"/>
            <joint name="{p}finger_a" type="slide" axis="0 1 0" range="0 {FINGER_OPEN}" damping="2"/>
            <geom name="{p}finger_a" type="box" size="{fx} {fy} {fz}" rgba="{arm.finger_color}" contype="0"
                conaffinity="0"/>
            <geom name="{p}finger_a_pad0" type="sphere" pos="{-pad_x} 0 {-pad_z}" size="{fy}" group="3" contype="0"
                conaffinity="1" friction="1.2 0.01 0.001"/>
            <geom name="{p}finger_a_pad1" type="sphere" pos="{pad_x} 0 {-pad_z}" size="{fy}" group="3" contype="0"
                conaffinity="1" friction="1.2 0.01 0.001"/>
          </body>
          <body name="{p}finger_b" gravcomp="1">
            <inertial pos="0 0 0" mass="0.1" diaginertia="1e-4 1e-4 1e-4"/>
            <joint name="{p}finger_b" type="slide" axis="0 -1 0" range="0 {FINGER_OPEN}" damping="2"/>
            <geom name="{p}finger_b" type="box" size="{fx} {fy} {fz}" rgba="{arm.finger_color}" contype="0"
                conaffinity="0"/>
            <geom name="{p}finger_b_pad0" type="sphere" pos="{-pad_x} 0 {-pad_z}" size="{fy}" group="3" contype="0"
                conaffinity="1" friction="1.2 0.01 0.001"/>
            <geom name="{p}finger_b_pad1" type="sphere" pos="{pad_x} 0 {-pad_z}" size="{fy}" group="3" contype="0"
                conaffinity="1" friction="1.2 0.01 0.001"/>
          </body>
        </body>
      </body>
    </body>"""


def _arm_actuators(arm: ArmSpec) -> str:
    p = arm.prefix
    return f"""
    <position name="{p}x" joint="{p}x" kp="800" forcerange="-{ARM_FORCE} {ARM_FORCE}"
        ctrlrange="{arm.x_range[0]} {arm.x_range[1]}"/>
    <position name="{p}y" joint="{p}y" kp="800" forcerange="-{ARM_FORCE} {ARM_FORCE}"
        ctrlrange="{arm.y_range[0]} {arm.y_range[1]}"/>
    <position name="{p}z" joint="{p}z" kp="800" forcerange="-{ARM_FORCE} {ARM_FORCE}"
        ctrlrange="{arm.z_range[0]} {arm.z_range[1]}"/>
    <position name="{p}finger_a" joint="{p}finger_a" kp="300" forcerange="-{FINGER_FORCE} {FINGER_FORCE}"
        ctrlrange="0 {FINGER_OPEN}"/>
    <position name="{p}finger_b" joint="{p}finger_b" kp="300" forcerange="-{FINGER_FORCE} {FINGER_FORCE}"
        ctrlrange="0 {FINGER_OPEN}"/>"""


def scene_xml(arms: tuple[ArmSpec, ...], objects: str, *, wrist_names: tuple[str, ...]) -> str:
    """A complete MJCF document: table, light, scene camera, ``arms`` and extra ``objects``."""
    if len(arms) != len(wrist_names):
        raise ValueError(f"wrist_names must name one camera per arm, got {wrist_names} for {len(arms)} arms")
    scene_cam = _camera_axes(SCENE_CAMERA["pos"], SCENE_CAMERA["look_at"])
    arm_bodies = "".join(_arm_xml(a, w) for a, w in zip(arms, wrist_names, strict=True))
    actuators = "".join(_arm_actuators(a) for a in arms)
    return f"""<mujoco model="embodied_jax_scene">
  <compiler angle="radian" autolimits="true"/>
  <option timestep="{TIMESTEP}" integrator="implicitfast" iterations="8" ls_iterations="8" impratio="10"/>
  <visual><headlight ambient="0.3 0.3 0.3" diffuse="0.3 0.3 0.3"/></visual>
  <asset>
    <material name="table" rgba="0.62 0.55 0.45 1"/>
  </asset>
  <worldbody>
    <light name="sun" pos="0 -0.3 1.2" dir="0 0.25 -1" directional="true" diffuse="0.6 0.6 0.6"/>
    <geom name="table" type="plane" size="0.6 0.6 0.02" material="table" contype="2" conaffinity="0"/>
    <camera name="scene" pos="{_vec(SCENE_CAMERA["pos"])}" xyaxes="{scene_cam}" fovy="{SCENE_CAMERA["fovy"]}"/>
    {arm_bodies}
    {objects}
  </worldbody>
  <actuator>{actuators}
  </actuator>
</mujoco>"""


def target_xml(name: str = "target", rgba: str = "0.9 0.15 0.15 1", radius: float = 0.022) -> str:
    """A visual-only sphere on a mocap body (its pose is set per episode)."""
    return f"""
    <body name="{name}" mocap="true" pos="0 0 0.1">
      <geom name="{name}" type="sphere" size="{radius}" rgba="{rgba}" contype="0" conaffinity="0"/>
    </body>"""


def goal_pad_xml(name: str = "goal", rgba: str = "0.2 0.8 0.3 1", half: float = 0.04) -> str:
    """A flat visual-only square marker on a mocap body, lying on the table."""
    return f"""
    <body name="{name}" mocap="true" pos="0 0 0.001">
      <geom name="{name}" type="box" size="{half} {half} 0.001" rgba="{rgba}" contype="0" conaffinity="0"/>
    </body>"""


def block_xml(name: str = "cube", half=(0.02, 0.02, 0.02), rgba: str = "0.15 0.35 0.9 1", mass: float = 0.05) -> str:
    """A free-floating box that collides with the table and the fingers."""
    hx, hy, hz = half
    return f"""
    <body name="{name}" pos="0 0 {hz}">
      <freejoint name="{name}"/>
      <geom name="{name}" type="box" size="{hx} {hy} {hz}" mass="{mass}" rgba="{rgba}" contype="1" conaffinity="2"
          friction="1.2 0.01 0.001"/>
    </body>"""
