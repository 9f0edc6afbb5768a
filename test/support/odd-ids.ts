/**
 * Ids from other systems (STYLE.md 12), for every place an id becomes a URL, a header or a label:
 * dot segments, a slash, an encoded slash, query and fragment characters, a space, sub-delims,
 * non-Latin-1 (euro sign, CJK).
 */
export const ODD_IDS: readonly string[] = ['.', '..', 'a/b', '%2F', 'x?y#z', 'with space', '€', '資産', "it's!(*)", '../..', '...'];
