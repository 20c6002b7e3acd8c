//! A record's optional strings packed into one allocation: the decision
//! log's line and a decision's span each copy a handful of the call's
//! strings at decision time, and one `String` with their ends costs one
//! allocation where a `String` each would cost up to eight.

/// Up to `N` (at most 8) optional strings in one buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Texts<const N: usize> {
    text: String,
    /// Where each string ends in `text` (an absent one ends where the
    /// previous did).
    ends: [u32; N],
    /// Bit `i` set: string `i` is present (an empty one included).
    present: u8,
}

impl<const N: usize> Texts<N> {
    /// Copies `parts` into one buffer.
    pub fn pack(parts: [Option<&str>; N]) -> Texts<N> {
        const { assert!(N <= 8, "present is a u8") };
        let mut text = String::with_capacity(parts.iter().flatten().map(|part| part.len()).sum());
        let mut ends = [0; N];
        let mut present = 0;
        for (index, part) in parts.into_iter().enumerate() {
            if let Some(part) = part {
                text.push_str(part);
                present |= 1 << index;
            }
            ends[index] = text.len() as u32;
        }
        Texts {
            text,
            ends,
            present,
        }
    }

    /// String `index`, if it was present.
    pub fn get(&self, index: usize) -> Option<&str> {
        if self.present & (1 << index) == 0 {
            return None;
        }
        let start = if index == 0 {
            0
        } else {
            self.ends[index - 1] as usize
        };
        self.text.get(start..self.ends[index] as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_and_empty_strings_are_told_apart() {
        let texts = Texts::pack([Some("id"), None, Some(""), Some("pay")]);
        assert_eq!(texts.get(0), Some("id"));
        assert_eq!(texts.get(1), None);
        assert_eq!(texts.get(2), Some(""));
        assert_eq!(texts.get(3), Some("pay"));
    }
}
