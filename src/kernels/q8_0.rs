//! Q8_0 kernels (not yet implemented in this build: `kernels_for` reports the type as unsupported).

use super::TypeKernels;

pub(super) const KERNELS: Option<TypeKernels> = None;
