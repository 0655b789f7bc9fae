//! A grouped allreduce submitted as one op: its tensors packed into one tensor per dtype
//! ([`crate::fusion::packed_group`]), each negotiated, cached and reduced as one tensor of its dtype.
//!
//! A group whose tensors have several dtypes becomes one packed tensor per dtype, in order of first
//! appearance: the first keeps the group's name, the others are named `<name>.<k>`.

use crate::engine::handles::HandleId;
use crate::engine::small_op::Detach;
use crate::engine::submission::{OpSubmission, TensorSubmission};
use crate::engine::Engine;
use crate::error::EngineError;
use crate::fusion::packed_group::{pack_by_dtype, GroupMember};
use crate::tensor::RawTensor;

impl Engine {
    /// Submit the grouped allreduce `name` of `members` (output slots in list order; results written into
    /// them with `in_place`) with `op`'s settings on process set `set_id`. With `drive`, the caller waits for
    /// it next: it may run right here, under `drive` (see [`Engine::submit_and_drive`]).
    pub fn submit_group(
        &self,
        name: &str,
        members: Vec<GroupMember>,
        in_place: bool,
        mut op: OpSubmission,
        set_id: u32,
        drive: Option<&impl Detach>,
    ) -> Result<HandleId, EngineError> {
        op.tensors = pack_group(name, members, in_place);
        match drive {
            Some(detach) => self.submit_and_drive(op, set_id, detach),
            None => self.submit(op, set_id),
        }
    }
}

/// Group `members` into one submission per dtype, named as the module says. Nothing is copied here: the
/// submission's `input` is empty and the group is gathered when it runs.
pub fn pack_group(name: &str, members: Vec<GroupMember>, in_place: bool) -> Vec<TensorSubmission> {
    pack_by_dtype(members, in_place)
        .enumerate()
        .map(|(k, group)| {
            let dtype = group.dtype();
            TensorSubmission {
                name: if k == 0 { name.to_string() } else { format!("{name}.{k}") },
                dtype,
                shape: vec![(group.len_bytes() / dtype.size()) as i64],
                // SAFETY: a zero-length view of no memory; the group's bytes are reached through `packed`.
                input: unsafe { RawTensor::new(std::ptr::null_mut(), 0) },
                device: None,
                in_place,
                packed: Some(group),
                into: None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::DataType;

    #[test]
    fn a_group_is_one_submission_per_dtype_the_first_named_after_it() {
        let mut a = vec![1u8, 2, 3, 4]; // f32 [1]
        let mut b = vec![5u8; 8]; // f64 [1]
        let mut c = vec![6u8, 7, 8, 9, 10, 11, 12, 13]; // f32 [2]
                                                        // SAFETY: the test keeps the vectors alive and untouched while the views are used.
        let view = |data: &mut Vec<u8>| unsafe { RawTensor::new(data.as_mut_ptr(), data.len()) };
        let members = vec![
            GroupMember { input: view(&mut a), dtype: DataType::Float32, shape: vec![1] },
            GroupMember { input: view(&mut b), dtype: DataType::Float64, shape: vec![1] },
            GroupMember { input: view(&mut c), dtype: DataType::Float32, shape: vec![2] },
        ];
        let subs = pack_group("grouped_allreduce.g", members, true);
        let described: Vec<_> =
            subs.iter().map(|s| (s.name.as_str(), s.dtype, s.shape.clone(), s.output_slots())).collect();
        assert_eq!(
            described,
            vec![
                ("grouped_allreduce.g", DataType::Float32, vec![3], 2),
                ("grouped_allreduce.g.1", DataType::Float64, vec![1], 1)
            ]
        );
        assert!(subs.iter().all(|s| s.in_place && s.input.is_empty()));
    }
}
