"""The linguistic probes: indirect object identification, subject-verb agreement across an attractor,
anaphor agreement. Templates and word lists are written for headscope (docs/DEFINITIONS.md, "What a cut
breaks", says where each task comes from); every filler must be one token of the model's tokenizer
with its leading space, and the ones that are not are left out and counted.

Masked LMs read the same sentences with the answer masked and the sentence closed after it.
"""
from __future__ import annotations

from analysis.measure.probes.items import Draft, Probe, Vocabulary

NAMES = ("Mary", "John", "Anna", "James", "Sarah", "David", "Laura", "Michael", "Emma", "Robert", "Lisa",
         "Daniel", "Kate", "Paul", "Alice", "Mark", "Susan", "Peter", "Julia", "Thomas", "Rachel", "Steven",
         "Linda", "George", "Helen", "Richard", "Amy", "Frank", "Karen", "Henry", "Ruth", "Brian", "Nancy",
         "Kevin", "Sophie", "Adam", "Claire", "Tom", "Jane", "Ben", "Lucy", "Sam", "Grace", "Jack", "Rose", "Max")
PLACES = ("store", "park", "school", "office", "library", "station", "market", "beach", "museum", "restaurant",
          "hospital", "garden", "kitchen", "cafe", "farm", "theater", "airport", "hotel", "bakery", "harbor")
THINGS = ("drink", "book", "letter", "ball", "gift", "key", "ticket", "bag", "phone", "pen", "map", "cake",
          "card", "hat", "coin", "note", "box", "cup", "lamp", "shirt")
IOI_TEMPLATES = (
    "When {A} and {B} went to the {place}, {B} gave a {thing} to",
    "After {A} and {B} arrived at the {place}, {B} handed a {thing} to",
    "{A} and {B} spent the afternoon at the {place}. Later, {B} passed a {thing} to",
    "While {A} and {B} were waiting at the {place}, {B} offered a {thing} to",
    "Yesterday {A} and {B} met at the {place}, and {B} showed a {thing} to",
    "At the {place}, {A} and {B} sat together. Then {B} sent a {thing} to",
)


class IOIProbe(Probe):
    """Indirect object identification: two names, the second repeated as the giver; the model should
    name the other one. Answer: the name mentioned once; contrast: the repeated one. The order of the
    two names alternates (ABB: the answer first; BAB: the answer second) and the templates rotate."""

    def drafts(self, vocab: Vocabulary, kind: str) -> list[Draft]:
        names = vocab.keep("names", NAMES)
        places, things = vocab.keep("places", PLACES), vocab.keep("objects", THINGS)
        if len(names) < 2 or not places or not things:
            return []

        def make(i, rng):
            template = IOI_TEMPLATES[i % len(IOI_TEMPLATES)]
            order = ("ABB", "BAB")[(i // len(IOI_TEMPLATES)) % 2]
            a, b = rng.sample(names, 2)                                # a: the answer, b: the repeated name
            first, second = (a, b) if order == "ABB" else (b, a)
            prompt = template.replace("{A} and {B}", f"{first} and {second}").format(
                B=b, place=rng.choice(places), thing=rng.choice(things))
            return vocab.complete(prompt, " " + a, " " + b, condition=order)
        return self.collect(make)

NOUNS = (("key", "keys"), ("book", "books"), ("bottle", "bottles"), ("letter", "letters"), ("picture", "pictures"),
         ("dog", "dogs"), ("car", "cars"), ("teacher", "teachers"), ("student", "students"), ("author", "authors"),
         ("door", "doors"), ("window", "windows"), ("table", "tables"), ("chair", "chairs"), ("road", "roads"),
         ("tree", "trees"), ("house", "houses"), ("friend", "friends"), ("doctor", "doctors"),
         ("painting", "paintings"), ("report", "reports"), ("machine", "machines"), ("farmer", "farmers"),
         ("player", "players"), ("officer", "officers"), ("manager", "managers"), ("box", "boxes"),
         ("girl", "girls"), ("boy", "boys"), ("cat", "cats"), ("cabinet", "cabinets"), ("garden", "gardens"))
PREPOSITIONS = ("to", "near", "behind", "beside", "next to", "in front of", "on top of", "under", "with", "for",
                "of", "from", "by", "above")
BE = ((" is", " are"), (" was", " were"))
AGREEMENT_CONDITIONS = (("singular", "singular"), ("singular", "plural"), ("plural", "singular"),
                        ("plural", "plural"))


class AgreementProbe(Probe):
    """Subject-verb agreement across an attractor: "The keys to the cabinet" -> " are" over " is". The
    four number combinations of subject and attractor rotate (balanced); the verb is is/are or was/were."""

    def drafts(self, vocab: Vocabulary, kind: str) -> list[Draft]:
        nouns = vocab.keep("nouns (singular/plural)", NOUNS)
        verbs = vocab.keep("verb pairs", [(s.strip(), p.strip()) for s, p in BE])
        if len(nouns) < 2 or not verbs:
            return []

        def make(i, rng):
            subject_number, attractor_number = AGREEMENT_CONDITIONS[i % 4]
            subject, attractor = rng.sample(nouns, 2)
            singular, plural = rng.choice(verbs)
            pick = lambda pair, number: pair[number == "plural"]            # noqa: E731
            prompt = f"The {pick(subject, subject_number)} {rng.choice(PREPOSITIONS)} the {pick(attractor, attractor_number)}"
            right, wrong = (plural, singular) if subject_number == "plural" else (singular, plural)
            return vocab.complete(prompt, " " + right, " " + wrong, suffix=" here.",
                                  condition=f"{subject_number} subject, {attractor_number} attractor")
        return self.collect(make)

MALE = ("man", "boy", "king", "father", "brother", "actor", "husband", "uncle", "waiter", "son", "prince")
FEMALE = ("woman", "girl", "queen", "mother", "sister", "actress", "wife", "aunt", "waitress", "daughter", "princess")
GROUPS = ("men", "women", "boys", "girls", "students", "doctors", "teachers", "players", "children", "farmers",
          "officers", "workers")
MALE_NAMES = ("John", "James", "David", "Michael", "Robert", "Daniel", "Paul", "Mark", "Peter", "Thomas", "George",
              "Richard", "Henry", "Brian", "Kevin", "Adam", "Tom", "Ben", "Jack", "Frank")
FEMALE_NAMES = ("Mary", "Anna", "Sarah", "Laura", "Emma", "Lisa", "Kate", "Alice", "Susan", "Julia", "Rachel",
                "Linda", "Helen", "Amy", "Karen", "Ruth", "Nancy", "Sophie", "Jane", "Lucy", "Grace", "Rose")
VERBS = ("hurt", "blamed", "praised", "admired", "helped", "introduced", "described", "fooled", "criticized",
         "forgave", "questioned", "trusted", "watched", "saw", "taught", "defended", "surprised", "hated")
REFLEXIVES = {"male": " himself", "female": " herself", "plural": " themselves"}
# a short lead-in before the subject: with the subject as the prompt's first word, SmolLM2 told
# "himself" from "herself" at 0.62 for male subjects (0.58 with a name; a BOS token did not help), with
# any of these in front at 1.0 (docs/results.md, "What a cut breaks")
LEAD_INS = ("Yesterday,", "In the story,", "At the party,", "After the game,", "Last week,", "That morning,")


class AnaphorProbe(Probe):
    """Anaphor agreement (BLiMP-style minimal pairs): "Yesterday, the queen hurt" -> " herself" over " himself".
    Male, female and plural subjects rotate (a name or "the" + noun) after a short lead-in; the contrast is
    the other gender for a singular subject and a singular reflexive for a plural one (number).
    lead_ins=False: the subject starts the prompt ("The queen hurt"; what docs/results.md compares)."""

    def __init__(self, n_items: int = 48, seed: int = 0, bos: str = "auto", lead_ins: bool = True):
        super().__init__(n_items, seed, bos)
        self.lead_ins = bool(lead_ins)

    def drafts(self, vocab: Vocabulary, kind: str) -> list[Draft]:
        subjects = {"male": [f"the {w}" for w in vocab.keep("male nouns", MALE)] + vocab.keep("male names", MALE_NAMES),
                    "female": [f"the {w}" for w in vocab.keep("female nouns", FEMALE)]
                    + vocab.keep("female names", FEMALE_NAMES),
                    "plural": [f"the {w}" for w in vocab.keep("plural nouns", GROUPS)]}
        verbs = vocab.keep("verbs", VERBS)
        conditions = [c for c in REFLEXIVES if subjects[c]]
        if not verbs or not conditions:
            return []

        def make(i, rng):
            condition = conditions[i % len(conditions)]
            if condition == "plural":
                wrong = REFLEXIVES[("male", "female")[(i // len(conditions)) % 2]]
            else:
                wrong = REFLEXIVES["female" if condition == "male" else "male"]
            lead = rng.choice(LEAD_INS) + " " if self.lead_ins else ""
            subject = rng.choice(subjects[condition])
            prompt = f"{lead}{subject if lead else subject[0].upper() + subject[1:]} {rng.choice(verbs)}"
            return vocab.complete(prompt, REFLEXIVES[condition], wrong, condition=condition)
        return self.collect(make)
