"""Hand-written templates and fillers for the synthetic training prompts (§6 self-distillation).

Everything here was written for this project: nothing is copied from ShareGPT, MT-bench or
HumanEval, and topics those benchmarks ask about (Fibonacci, palindromes, primes, dice, LCS,
photosynthesis, ...) are left out on purpose. ``eagle2.train.prompts`` samples from the
product templates x slot values of each category and checks n-gram disjointness from the
benchmarks. A template field ``{slot}`` takes one value of ``slots[slot]``; ``{slot[i]}``
indexes into a tuple value, for fields that must agree (a SQL schema and its question).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class CategorySpec:
    """One kind of prompt: its share of the mix and the product space it is drawn from."""

    name: str
    group: str  # "general" | "code" | "math"
    weight: float  # share of all prompts; the weights of all categories sum to 1
    templates: tuple[str, ...]
    slots: Mapping[str, tuple]  # slot name -> its values (str, or tuple for {slot[i]})


def _nums(start: int, stop: int, step: int = 1) -> tuple[str, ...]:
    return tuple(str(i) for i in range(start, stop, step))


def _split(block: str) -> tuple[str, ...]:
    """The values of ``block``, separated by newlines or " | "."""
    return tuple(item.strip() for item in block.replace("\n", "|").split("|") if item.strip())


def _paragraphs(block: str) -> tuple[str, ...]:
    """The paragraphs of ``block`` (separated by blank lines), each joined into one line."""
    return tuple(" ".join(par.split()) for par in block.strip().split("\n\n"))


# ----------------------------------------------------------------------------- general

AUDIENCES = ("a ten-year-old", "a high school student", "a first-year university student",
             "a busy manager with five minutes", "someone with no science background",
             "a retired carpenter", "a new employee at a bank", "a curious grandparent",
             "a nursing student", "a journalist writing a short piece")

CONCEPTS = _split("""
compound interest | plate tectonics | the water cycle
how vaccines teach the immune system to respond | opportunity cost
the difference between weather and climate | how GPS works out your position
why the sky looks blue during the day | how credit scores work | supply and demand
how a refrigerator keeps food cold | the placebo effect | how noise-cancelling headphones work
the scientific method | what a black hole is | how the Moon causes tides | how bees make honey
why leaves change color in autumn | how a moving bicycle stays upright
how the heart pumps blood around the body | how antibiotics work and why resistance develops
how an electric motor turns | how solar panels turn sunlight into electricity
what a recession is | how interest rates affect borrowing | how a search engine ranks pages
public-key encryption | how a message finds its way across the internet | the Doppler effect
how earthquakes are measured | what a carbon footprint is | how sleep affects memory
what an index fund is | how rainbows form | why ice floats on water
how a camera lens focuses light | natural selection | the life cycle of a star
how a jet engine produces thrust | why we have leap years | how coral reefs grow
how muscles get stronger after exercise | double-entry bookkeeping
how wind turbines generate power | how a microwave oven heats food | how a thermostat works
how a stock exchange works | what a budget deficit is | how plastic recycling works
how rechargeable batteries store energy | why time zones exist
the difference between a virus and a bacterium | how yogurt is made by fermentation
herd immunity | how airplane wings create lift | how volcanoes erupt | how a mortgage works
how a compass finds north | entropy | how a 3D printer builds an object
how touch screens detect a finger | how a hydroelectric dam makes electricity | why bread rises
what inflation-adjusted prices mean | how a hearing aid works | how glaciers shape valleys
""")

EXPLAIN_STYLES = ("", "Use one everyday analogy.", "Keep it under 150 words.",
                  "Use three short paragraphs.", "Finish with a one-sentence summary.",
                  "Avoid jargon.", "Include a concrete example.",
                  "Use a numbered list of key points.", "Mention one common misconception.")

HOWTO_TASKS = _split("""
repot a houseplant | set up a monthly budget | prepare for a job interview
start a vegetable garden on a balcony | fix a dripping kitchen tap | change a flat bicycle tire
learn to touch type | back up the photos on my phone | train a puppy to sit
plan a week of healthy dinners | write a good cover letter | ask for a raise
clean a cast iron pan | start running as an adult | organize a small closet
bake a simple loaf of bread | study for a final exam in two weeks
give a short toast at a wedding | reduce my screen time | set up a home Wi-Fi network securely
paint a room without making a mess | pack for a week-long trip with only a carry-on
keep a journal consistently | learn a new language on a budget | host a board game night
improve my sleep routine | compost kitchen scraps in an apartment | prepare for a long day hike
plan a child's birthday party | choose a good used car | declutter a garage
start saving for retirement | write a clear meeting agenda | take better photos with a phone
make cold brew coffee at home | hang a heavy mirror on drywall | teach a child to ride a bike
get a house ready for winter | memorize a short speech | sharpen a kitchen knife
organize receipts for my taxes | plan a road trip | learn basic first aid
start a neighborhood book club | build a simple birdhouse
get rid of fruit flies in the kitchen | keep houseplants alive while I'm on vacation
set realistic goals for the new year
""")

HOWTO_EXTRAS = ("", "Keep it to seven steps or fewer.", "Mention the tools I need.",
                "Point out the most common mistake.", "Assume I have a small budget.",
                "Assume I only have one weekend.", "Explain why each step matters.")

ESSAY_TOPICS = _split("""
the value of public libraries | why people collect things | the role of boredom in creativity
how cities could become friendlier to pedestrians | what makes a good teacher
the history and future of handwritten letters | friendship across generations
the ethics of keeping animals in zoos | the influence of music on mood
the pros and cons of working from home | what team sports teach us about losing
the meaning of home | the joy of cooking for others | light pollution and the night sky
why humans tell stories | the role of volunteers in small towns | the future of public transport
how maps shape the way we see the world | the lessons of a failed project
the appeal of simple living | why local news matters | the art of listening
what a good city park needs | repairing things instead of replacing them
why people enjoy scary films | the role of rituals in daily life | how weather shapes our moods
the power of small habits | kindness toward strangers | what makes a place feel safe
the hidden cost of cheap clothing | learning from mistakes
""")

ESSAY_ANGLES = ("Take a historical perspective.", "Open with a personal anecdote.",
                "Present two sides before giving your view.",
                "Use at least one concrete example.", "Write it for a school newspaper.",
                "Write it for a general audience.")

ESSAY_LENGTHS = ("Aim for about 250 words.", "Keep it under 300 words.", "Use four paragraphs.",
                 "Aim for about 400 words.")

ESSAY_CLAIMS = _split("""
every school should teach basic cooking | city buses should be free to ride
homework should be optional in primary school | museums should stay open late at night
people should learn to mend their own clothes | a four-day work week would help most companies
every town needs a public swimming pool | cars should be kept out of city centers on Sundays
board games beat video games for family evenings | tipping should be replaced by higher wages
handwriting should still be taught in schools | libraries should lend tools as well as books
plastic bags should cost money everywhere | students should take a gap year before university
offices should have quiet rooms for short naps
""")

ESSAY_TONES = ("short", "300-word", "five-paragraph", "balanced but firm", "light-hearted")

CHARACTERS = _split("""
a retired mail carrier | a shy robot | a young chef | a lighthouse keeper | an elderly cat
a street musician | a teenage inventor | a nervous substitute teacher | a lost hiking guide
a talking crow | a grandmother who drives a taxi | a baker with a secret | a small dragon
a museum night guard | two rival gardeners | a kid who collects rocks | a tired astronaut
a village librarian | an old fisherman | a mapmaker | a clockmaker
a firefighter on her first day | a delivery drone
""")

SITUATIONS = _split("""
has to win back a friend's trust | discovers a door that was not there yesterday
gets stuck in an elevator with a stranger | must deliver a package before sunset
loses the one thing they cannot replace | is asked to keep a secret that could help everyone
starts hearing music that nobody else can hear | enters a baking contest by mistake
finds a map drawn by their younger self | has one day to repair a broken bridge
is mistaken for a famous person | organizes a festival in a town that forgot how to celebrate
adopts an animal that keeps growing | is the last person in town who remembers an old song
has to teach someone they dislike | gets a second chance at a race they lost
tries to keep a promise during a storm | plants a seed that grows overnight
loses their voice the day before a big performance | must find a new home for a family of ducks
""")

SETTINGS = _split("""
a small harbor town | a city on the Moon | a snowed-in mountain village | a busy night market
a desert research station | a floating city | a quiet suburb in the 1980s
an old train crossing the plains | a rainforest camp | a school on an island
a medieval castle kitchen | an underground city | a ferry in thick fog
a circus that travels by river | a seaside campsite
""")

STORY_EXTRAS = ("", "Keep it under 400 words.", "Give it a hopeful ending.",
                "Tell it in the first person.", "End with an unexpected twist.",
                "Write it for children aged six to eight.", "Use plenty of dialogue.")

EMAIL_PURPOSES = _split("""
to your landlord asking them to repair a broken heater
to a colleague asking to swap shifts next Friday
to a professor requesting an extension on an assignment
to a customer apologizing for a delayed order
to a hiring manager following up after an interview
to your team announcing a new weekly meeting time
to a neighbor about a package delivered to the wrong house
to a client politely turning down a project
to a friend inviting them on a weekend camping trip | to a hotel asking about an early check-in
to the local council reporting a broken streetlight | to a former manager asking for a reference
to a gym cancelling a membership | to a supplier asking for a bulk discount
to the parents of a class about an upcoming field trip
to a conference organizer proposing a talk | to a coworker thanking them for help on a project
to your bank disputing a charge you don't recognize
to a volunteer group recruiting helpers for a beach clean-up
to your landlord giving notice that you are moving out
to a new client explaining the next steps of the project
to an airline requesting a refund for a cancelled flight | to a plumber asking for a quote
to your manager asking to work remotely two days a week
to a book club announcing next month's book | to an author praising their latest novel
to a restaurant booking a table for twelve people
to a tenant reminding them that rent is overdue | to a vendor rescheduling a delivery
to students explaining that the exam date has changed
to a mentor asking for a short call about career plans
to customers announcing new opening hours | to a recruiter saying you accepted another offer
to your team summarizing the decisions from today's meeting
""")

EMAIL_TONES = ("Keep the tone friendly.", "Make it formal.", "Be polite but firm.",
               "Sound warm and grateful.", "Keep it neutral and factual.", "Make it upbeat.")

EMAIL_SHAPES = ("Keep it under 120 words.", "Include a clear subject line.",
                "End with a specific request.", "Use no more than three short paragraphs.")

LIST_THINGS = _split("""
ideas for a rainy day with kids | names for a neighborhood bakery
questions to ask a landlord before signing a lease | cheap hobbies to start this year
tips for staying focused while studying | ways to reduce food waste at home
icebreaker questions for a team meeting | things to pack for a day at the beach
low-cost date ideas | topics for a school science fair | healthy snacks for the office
ways to welcome a new coworker | themes for a costume party
reasons to learn a musical instrument | ways to save water in the garden
conversation starters for a family dinner | houseplants that are hard to kill
practical skills every teenager should learn | board games for a group of six
ways to make a small apartment feel bigger | birthday gift ideas for a grandparent
warning signs of a phishing email | ideas for a community fundraiser
tips for a first camping trip | features to look for in a password manager
ways to make a long drive more fun | questions for a customer satisfaction survey
names for a pet turtle | things to check before buying a used bike
lunchbox ideas that need no heating | ways to make meetings shorter
activities for a team-building day | genres to try for someone who only reads thrillers
simple ways to waste less at the office | ideas for a weekend in your own city
mistakes new gardeners make | habits that make emails easier to read
questions to ask a doctor at a yearly check-up | ways to celebrate a small win
""")

COUNTS = ("three", "four", "five", "six", "seven", "eight", "ten")

LIST_FORMATS = ("", "Use a numbered list.", "Sort them from easiest to hardest.",
                "Keep each item under fifteen words.", "Group them into two categories.",
                "Add a short reason for each.")

COMPARE_PAIRS = _split("""
renting and buying a home | trains and planes for a 500-kilometre trip | tea and coffee
e-books and paper books | living in a city and living in the countryside
running and swimming as exercise | cats and dogs as pets | electric cars and hybrid cars
credit cards and debit cards | gas stoves and induction stoves
learning guitar and learning piano | freelancing and full-time employment
camping and staying in a hotel | handwritten notes and typed notes
laptops and tablets for school work | cycling and driving to work | group travel and solo travel
a gym membership and working out at home | fresh and frozen vegetables | podcasts and audiobooks
small weddings and large weddings | wood and metal furniture
Spanish and French as a first foreign language | watercolor and acrylic paint for beginners
hiking boots and trail running shoes | paper planners and calendar apps
studying in the morning and studying at night | buying new and buying secondhand furniture
a mountain bike and a road bike | oral exams and written exams
""")

COMPARE_ANGLES = ("for someone on a tight budget", "from an environmental point of view",
                  "for a family with young children", "in terms of long-term costs",
                  "for a complete beginner", "in terms of convenience and time",
                  "for a student", "for someone with limited space")

COMPARE_FORMATS = ("", "Use a table.", "End with a recommendation.",
                   "Keep it under 200 words.", "List pros and cons for each.")

ROLES = _split("""
a lighthouse keeper in the year 1900 | a medieval blacksmith | a friendly museum guide
a ship's cook on a long voyage | a park ranger in a national park | a barista at a busy cafe
a travel agent who loves trains | a patient piano teacher | a retired detective | a beekeeper
a weather forecaster on live TV | a librarian in a tiny village | a tour guide in ancient Rome
an astronaut on a space station | a chess coach | a gardener at a royal palace
a sports commentator | a customer support agent for an internet provider
a zookeeper who looks after penguins | a chef at a seaside restaurant | a career counselor
a friendly alien visiting Earth for the first time | a pirate captain who is afraid of water
a mountain guide | a nervous first-time author at a book signing
the host of a late-night radio show | a Victorian inventor | a village baker
""")

ROLE_QUESTIONS = _split("""
What does a normal day look like for you?
What advice would you give someone starting out in your line of work?
Tell me about the hardest day you remember. | What do most people misunderstand about your job?
How do you deal with difficult people? | Describe your favorite tool and why you like it.
What did you learn from your biggest mistake? | Recommend something I should try today.
What are you most proud of? | What changes have you seen over the years?
How would you spend a free afternoon? | Give me a quick tip I can use right away.
What is the strangest request you have ever received? | How do you stay motivated?
Explain one part of your work as if I were a child.
What would you change about your job if you could? | Tell me a short story from your work.
What question do people ask you most often, and how do you answer it?
""")

FORMS = ("haiku", "limerick", "four-line poem", "product description", "short speech",
         "diary entry", "radio advertisement", "fable", "postcard message",
         "recipe introduction", "song chorus", "motivational note", "two-paragraph story",
         "museum label", "short review")

THEMES = ("a rainy Monday", "the first snowfall", "a lost umbrella", "an old bicycle",
          "morning coffee", "a crowded train", "a garden in spring", "a new pair of shoes",
          "moving to a new city", "a power cut", "the last day of school", "a lighthouse",
          "a homemade pizza", "a library at night", "a stubborn goat", "learning to swim",
          "a thunderstorm", "a quiet beach in winter", "a broken clock", "the smell of bread",
          "a long queue", "a road trip playlist", "a kite festival", "a forgotten birthday",
          "a city park at dawn")

RULES_A = ("uses fewer than 80 words", "is written in the second person",
           "mentions a color in every sentence", "includes the word 'lantern'",
           "ends with a question", "has exactly three sentences", "uses only the present tense",
           "includes a number", "opens with a sound effect", "has a title in capital letters")

RULES_B = ("avoids the word 'very'", "has a hopeful tone", "rhymes at least once",
           "gives the reader a piece of advice", "mentions the weather", "uses a simile",
           "sounds slightly sarcastic", "names a real city")

DILEMMAS = _split("""
I just started a new job and I feel like I ask too many questions.
My roommate never does the dishes. | I have two job offers and can't decide between them.
I want to exercise more but I'm always tired after work.
A friend borrowed money months ago and hasn't mentioned it since.
I keep putting off a big school project.
My small shop gets good reviews but few new customers.
I'm nervous about moving abroad for a year. | My teenager spends every evening on their phone.
I missed an important deadline at work. | I want to switch careers into graphic design at 35.
My neighbor's dog barks all night.
I have too many subscriptions and no idea where my money goes.
I feel stuck learning the guitar. | My team can't agree on which project to do first.
I want to read more books but I never finish them. | The tomatoes in my garden keep cracking.
My parents want me to study medicine but I love history. | I get anxious before every exam.
My friends can never agree on dates for a trip.
I moved to a new town and want to make friends. | My manager gives vague instructions.
I have a job interview tomorrow and I haven't prepared.
My old laptop is slow and I can't afford a new one.
I want to start a podcast but don't know where to begin. | My cat scratches the sofa.
I was offered a promotion that means a lot more travel. | I keep waking up at 3 a.m.
My partner on a group project isn't doing their share.
I want to cook at home more but only have twenty minutes each night.
I said something unkind to a friend and regret it. | My landlord wants to raise the rent a lot.
I have a free month before my new job starts. | I want to volunteer but I'm not sure where.
""")

DILEMMA_EXTRAS = ("", "Give me three options.", "Be honest, even if it's not what I want to hear.",
                  "Keep it short.", "Explain the trade-offs.",
                  "Suggest a first step I can take today.", "Ask me one clarifying question too.",
                  "Answer as a practical friend would.")

SENTENCES = _split("""
We regret to tell you that the meeting has been moved again.
The printer on the third floor is broken and nobody knows when it will be fixed.
Our app now loads twice as fast as before. | Please stop leaving dirty mugs in the sink.
I can't make it to the party on Saturday.
The train was late, so I missed the start of the concert.
The new policy starts next month and applies to all staff.
This recipe takes about an hour and serves four people.
Sales dropped in March because of the storm.
Submit the form before Friday or your request will be rejected.
The museum is closed on Mondays for cleaning. | Thanks for your help with the move last weekend.
The update fixes several bugs and improves battery life.
I think we should hire another designer.
The park will get new benches and better lighting this summer.
Your order has shipped and should arrive within five days.
We need volunteers to help paint the community center.
The results of the experiment were not what we expected.
The cafe on the corner makes the best cinnamon rolls in town.
Parking is no longer free after 6 p.m. | The trail is muddy after the rain, so wear good boots.
The report is late because two people were sick. | Our team won the regional quiz night.
The library will start charging fees for late returns.
We need to cut the travel budget by ten percent.
The concert was loud, crowded, and absolutely wonderful.
I've decided to leave the company at the end of the year.
The kitchen renovation is taking longer than planned.
The bus route will change while the bridge is repaired.
""")

REWRITE_STYLES = ("more formal", "more casual", "more polite", "shorter", "more persuasive",
                  "more cheerful", "clearer for a non-native speaker", "less technical",
                  "more enthusiastic", "more diplomatic", "more vivid", "more neutral")

PARAGRAPHS = _paragraphs("""
The town of Millbrook opened its first public library in 1911 with just four hundred books
donated by local families. Over the next century it moved three times, each time into a larger
building. Today it lends not only books but also telescopes, sewing machines and board games,
and its busiest day is Saturday, when about six hundred people visit.

Urban beekeeping has grown quickly in the last decade. Rooftop hives now sit on hotels, schools
and office towers in many large cities. Supporters say the bees help pollinate parks and
gardens, while some researchers worry that too many hives compete with wild bees for a limited
supply of flowers.

A small bakery in a mountain village started selling bread by subscription last spring.
Customers pay once a month and collect a fresh loaf every morning. The owner says the scheme cut
her waste by almost half, because she now knows exactly how many loaves to bake each day.

Night trains are returning to several European routes after years of decline. Operators point to
travelers who want to avoid short flights and to save the cost of a hotel. The new sleeper cars
are quieter and more private than the old ones, but tickets often sell out weeks in advance.

In 2019 a coastal city replaced part of its concrete sea wall with a wide band of salt marsh.
The marsh absorbs the energy of storm waves and floods more gently than a wall would. It also
became a home for wading birds, and the city now runs guided walks there every weekend.

Many people set fitness goals in January and give up within two months. Coaches often suggest
starting with a target that feels almost too easy, such as a ten-minute walk after lunch. Once
the habit sticks, it is simpler to add time or intensity than to restart after a long break.

A survey of four hundred small restaurants found that most of their food waste came from
preparation, not from customers' plates. Trimming vegetables, over-ordering fresh fish and
cooking too much rice were the biggest sources. Restaurants that tracked waste for a month cut
it by a fifth on average.

The old railway line between the two valleys closed in 1965 and was turned into a cycling path
in 2004. The path is flat, paved and runs through six tunnels. Local cafes along the route say
cyclists now bring them more business in summer than the trains ever did.

Some schools have replaced one weekly lesson with an hour of unstructured reading. Students may
read anything they like, from comics to cookbooks, as long as they read quietly. Teachers report
calmer classrooms, although they admit it is hard to measure the effect on test scores.

A volunteer group in a river town spent three years restoring an abandoned water mill. They
rebuilt the wooden wheel by hand using old photographs as a guide. The mill now grinds flour on
the first Sunday of each month, and the flour is sold to raise money for the next repair.

Remote work has changed how some companies use their offices. Instead of rows of desks, they now
offer meeting rooms, quiet booths and a large kitchen where teams gather once or twice a week.
Managers say the office has become a place for collaboration rather than for routine tasks.

The island's only ferry runs twice a day in winter and six times a day in summer. When storms
cancel crossings, the island's shop can run short of fresh milk and bread within two days.
Residents have started a shared freezer and a list of neighbors who can lend supplies.

Community gardens in the city now have waiting lists of up to three years. Each plot is small,
about the size of a parking space, but gardeners grow enough vegetables to share with neighbors.
The city plans to open four new gardens on unused land next to railway lines.

An amateur astronomer spotted a new comet last winter using a telescope she built from
secondhand parts. She reported its position to an observatory, which confirmed the find two days
later. The comet now carries her name and will return in about seventy years.

A secondhand clothing shop started offering free repairs for anything bought there. Volunteers
fix zips, replace buttons and patch small holes on Tuesday evenings. The shop says customers now
come back more often and buy fewer items that they later throw away.

Electric scooters arrived in the city two summers ago and quickly became popular with commuters.
They also caused complaints about scooters left across sidewalks. The city responded by painting
parking boxes near bus stops and fining companies whose scooters were parked badly.
""")

SUMMARY_TASKS = _split("""
Summarize the following paragraph in one sentence.
Summarize this passage in two bullet points. | Summarize this passage in three bullet points.
Explain what this text says to a ten-year-old. | Write a headline for this paragraph.
Write three quiz questions about this passage, with answers. | List the key facts in this text.
Rewrite this paragraph in plain language.
Find every number in this text and say what it refers to.
What is the main idea of this paragraph? Explain briefly.
Turn this paragraph into a short social media post.
Suggest a title and a one-line summary for this text.
What questions does this paragraph leave unanswered?
Rewrite this paragraph as a short radio news item.
Describe the tone of this paragraph and explain why you think so.
Summarize this paragraph in under 30 words. | Summarize this text for a busy executive.
Give three keywords that describe this passage.
Explain this paragraph to someone who has never heard of the topic.
Turn this paragraph into a short dialogue between two people.
Point out any claims in this paragraph that would need a source.
Write a caption for a photo that could go with this text.
Summarize this passage, then give one opinion about it.
Write a follow-up question a reporter might ask after reading this.
""")

# -------------------------------------------------------------------------------- code

PY_FUNCTIONS = (
    ("slugify", "turns a title into a URL slug: lowercase words joined by hyphens"),
    ("chunk", "splits a list into consecutive chunks of a given size"),
    ("flatten_dict", ("flattens a nested dictionary into dotted keys, so {'a': {'b': 1}} "
                      "becomes {'a.b': 1}")),
    ("parse_duration", "parses strings like '1h30m' or '45s' into a number of seconds"),
    ("merge_intervals", "merges overlapping (start, end) time ranges"),
    ("run_length_encode", ("compresses a string with run-length encoding, so 'aaabcc' "
                           "becomes 'a3b1c2'")),
    ("wrap_text", "wraps a paragraph to a maximum line width without breaking words"),
    ("group_by_key", "groups a list of dictionaries by the value of a given key"),
    ("moving_average", "computes the moving average of a series over a window of size w"),
    ("parse_query", "parses a URL query string into a dictionary of lists"),
    ("format_bytes", "turns a byte count into a readable string such as '1.5 MB'"),
    ("deep_merge", "recursively merges two dictionaries, with the second one winning"),
    ("rotate_square", "rotates a square grid of values 90 degrees clockwise"),
    ("is_valid_ipv4", "checks whether a string is a valid IPv4 address"),
    ("camel_to_snake", "converts camelCase identifiers to snake_case"),
    ("business_days_between", "counts the weekdays between two dates"),
    ("parse_csv_line", "splits one CSV line into fields, respecting quoted commas"),
    ("binary_search", "returns the index of a target in a sorted sequence, or -1 if absent"),
    ("dedupe_by_key", "drops dictionaries whose key was already seen, keeping the first"),
    ("retry", "is a decorator that retries a call up to n times when it raises"),
    ("timed", "is a decorator that logs how long each call of the wrapped function takes"),
    ("memoize", "is a decorator that caches results for hashable arguments"),
    ("histogram_bins", "counts how many values fall into each of n equal-width bins"),
    ("mask_email", ("hides most of an email address, so 'jane.doe@example.com' becomes "
                    "'j***e@example.com'")),
    ("normalize_whitespace", "collapses runs of spaces, tabs and newlines into one space"),
    ("extract_hashtags", "returns the hashtags in a piece of text, without repeats"),
    ("percent_change", ("computes the percentage change between two values, handling a zero "
                        "start value")),
    ("future_value", "returns the value of a deposit after n years at a yearly interest rate"),
    ("check_password", ("checks a password for length, digits and mixed case, returning the "
                        "list of rules it breaks")),
    ("split_full_name", "splits a full name into first, middle and last names"),
    ("dict_diff", "reports the added, removed and changed keys between two dictionaries"),
    ("window_max", "returns the maximum of every window of size k in a sequence"),
    ("matmul", "multiplies two matrices given as lists of lists without NumPy"),
    ("count_code_lines", "counts the non-empty, non-comment lines in Python source code"),
    ("parse_access_log", "parses one web server access log line into a dictionary"),
    ("haversine_km", ("computes the distance in kilometres between two latitude/longitude "
                      "points")),
    ("find_overlaps", ("finds every pair of meetings that overlap in a list of (start, end) "
                       "times")),
    ("headline_case", ("capitalizes a headline but keeps short words like 'and' and 'of' "
                       "lowercase")),
    ("split_sentences", ("splits a text into pieces of at most n characters, breaking at "
                         "sentence ends when it can")),
    ("round_robin", "interleaves several lists, taking one element from each in turn"),
    ("pairwise_gaps", "returns the differences between neighbouring values of a sequence"),
    ("safe_divide", "divides two numbers and returns a default instead of raising on zero"),
    ("compare_versions", "compares two version strings like '2.10.3' and '2.9.12' correctly"),
    ("bucket_words", "groups words into a dictionary keyed by word length"),
    ("cumulative_sum", "returns the running totals of a sequence of numbers"),
    ("edit_distance", "computes the Levenshtein distance between two strings"),
    ("clamp", "limits a number to a given minimum and maximum"),
    ("make_password", "generates a random password of a given length with the secrets module"),
    ("invert_mapping", "inverts a dictionary, collecting keys that share a value into a list"),
    ("get_path", "looks up a value in nested JSON data using a path like 'users/0/name'"),
    ("weekday_of", "returns the weekday name of a date written as 'YYYY-MM-DD'"),
    ("render_table", "renders rows of values as a plain-text table with aligned columns"),
    ("tokenize_expr", "splits an arithmetic expression like '3+(4*12)' into tokens"),
    ("eval_rpn", "evaluates an expression written in reverse Polish notation"),
    ("order_tasks", "orders tasks so that each comes after all of its dependencies"),
    ("grid_path_length", ("finds the shortest path length through a grid with walls using "
                          "breadth-first search")),
)

FUNCTION_REQS = ("Include type hints and a docstring.", "Add a few example calls.",
                 "Explain its time complexity afterwards.", "Use only the standard library.",
                 "Raise ValueError on invalid input.", "Also write three pytest tests for it.",
                 "Keep it under 20 lines.", "Explain the code line by line.",
                 "Make it readable rather than clever.", "Mention one edge case it handles.")

PORTABLE_SPECS = tuple(spec for _, spec in PY_FUNCTIONS
                       if not spec.startswith("is a") and "Python" not in spec
                       and "secrets" not in spec and "NumPy" not in spec)

LANGUAGES = ("JavaScript", "TypeScript", "Go", "Rust", "Java", "C#", "Kotlin", "Ruby", "Swift",
             "PHP")

LANGUAGE_REQS = ("Add a short example of calling it.", "Explain the idioms you used.",
                 "Include a couple of unit tests.", "Keep it idiomatic.",
                 "Note how it would differ in Python.")

PY_CLASSES = (
    ("BoundedStack", "a stack with push, pop, peek and a maximum size"),
    ("LRUCache", "a least-recently-used cache with O(1) get and put"),
    ("LendingLibrary", ("a small library catalog where members borrow and return books with "
                        "due dates")),
    ("Inventory", "a shop inventory that tracks stock and warns when an item runs low"),
    ("Matrix", "a matrix type with addition, multiplication and a readable __repr__"),
    ("RateLimiter", "a token-bucket rate limiter that allows n requests per second"),
    ("Timer", "a context manager that measures how long a block of code takes"),
    ("EventBus", "a publish/subscribe event bus where handlers subscribe to named events"),
    ("TaskQueue", "a priority queue built on heapq that can change a task's priority"),
    ("ShoppingCart", "a shopping cart with items, quantities, discount codes and a total"),
    ("Vector2D", "a 2D vector with addition, scaling, length and dot product"),
    ("TodoList", "a to-do list that can add, complete and filter tasks by due date"),
    ("Graph", "an undirected graph that can add edges and find connected components"),
    ("RingBuffer", "a fixed-size buffer that overwrites the oldest item when full"),
    ("PrefixTree", "a trie that stores words and lists every word with a given prefix"),
    ("ParkingLot", "a parking lot with small and large spaces that assigns spaces to cars"),
    ("Thermostat", ("a thermostat with a target temperature and a mode that decides whether "
                    "to heat or cool")),
    ("Poll", "an online poll where each user votes once and results show as percentages"),
    ("CardDeck", "a deck of playing cards that can be shuffled and dealt into hands"),
    ("Money", "an amount in a currency that refuses to add amounts in other currencies"),
    ("Stopwatch", "a stopwatch with start, stop, lap and reset"),
    ("TextBuffer", "an editor buffer with insert, delete, undo and redo"),
    ("Settings", "a settings object loaded from a dictionary with defaults and type checks"),
    ("League", "a round-robin league that records results and prints a standings table"),
)

CLASS_REQS = ("Include a short usage example.", "Add type hints.",
              "Use a dataclass where it makes sense.", "Write unit tests with unittest.",
              "Keep methods short and document each one.", "Explain the design briefly.",
              "Raise clear errors for invalid operations.", "Add a __repr__ method.",
              "Make it safe to use from several threads.", "Keep it under 60 lines.")

SCRIPT_TASKS = _split("""
reads a CSV file of expenses and prints the total per category
renames every .jpeg file in a folder to .jpg
checks a list of URLs and reports which ones return an error status
watches a folder and prints the name of each new file
merges several JSON files that each contain a list into one file
prints the ten largest files under a directory | converts a Markdown table into CSV
asks the user for a number and prints its multiplication table
finds duplicate files in a folder by comparing hashes
backs up a directory into a zip file named with today's date
parses a web server log and counts requests per hour
builds a random weekly meal plan from a list of recipes
reports the number of lines, words and characters in a text file
plays a number-guessing game in the terminal
splits a large CSV file into files of 1,000 rows each | shows a countdown timer in the terminal
converts a CSV column of Fahrenheit temperatures to Celsius
prints the tasks from a JSON file that are due tomorrow
compares two text files and prints the lines that differ
cleans a CSV file by trimming spaces and dropping empty rows
logs daily water intake in a small SQLite database
reads a list of birthdays and prints whose birthday falls this week
counts how often each HTTP status code appears in a log file
joins a folder of text files into one Markdown document with headings
simulates 10,000 coin flips and plots the running share of heads with matplotlib
keeps a command-line to-do list in a JSON file
""")

SCRIPT_REQS = ("Use argparse for the options.", "Use only the standard library.",
               "Handle missing files gracefully.", "Put the logic in a main() function.",
               "Add comments explaining each part.", "Show an example of how to run it.",
               "Keep it under 40 lines.", "Print a helpful message when something goes wrong.")

SQL_TASKS = tuple(
    (schema, question)
    for schema, questions in (
        ("orders(id, customer_id, total, created_at) and customers(id, name, city)", (
            "lists the five customers who spent the most in 2023",
            "counts orders per city",
            "finds customers who have never placed an order",
            "shows revenue per month for the last twelve months",
            "returns each customer's first order date",
            "finds the average order value per customer")),
        ("employees(id, name, department_id, salary, hire_date) and departments(id, name)", (
            "finds the highest-paid employee in each department",
            "lists departments with more than ten employees",
            "computes the average salary per department",
            "finds employees hired in the last 90 days",
            "ranks employees by salary within their department",
            "lists departments that have no employees")),
        (("books(id, title, author_id, year, price), authors(id, name, country) and "
         "loans(id, book_id, member_id, loan_date, return_date)"), (
            "lists the books that are currently on loan",
            "finds the most borrowed book of each year",
            "counts books per author country",
            "lists members whose loans are more than 30 days overdue",
            "finds authors with no books published after 2000")),
        ("events(user_id, event_type, created_at)", (
            "counts daily active users",
            "computes a 7-day rolling count of 'signup' events",
            "finds users who were active on three consecutive days",
            "computes the share of users with a 'view' event who later have a 'purchase' event",
            "finds each user's first and last event")),
        (("products(id, name, category, price) and sales(id, product_id, store_id, quantity, "
         "sold_at)"), (
            "finds the best-selling product in each category",
            "shows total sales per store per month",
            "lists products that did not sell last month",
            "computes each product's share of its category's revenue",
            "finds the day with the highest revenue")),
    )
    for question in questions
)

SQL_REQS = ("Explain each clause.", "Use PostgreSQL syntax.", "Use a window function if it helps.",
            "Avoid subqueries if you can.", "Use a common table expression.",
            "Also suggest an index that would speed it up.", "Use SQLite syntax.")

SHELL_TASKS = _split("""
find all files larger than 100 MB under my home directory
count the lines in every .py file of a project | replace a word in every .txt file in a folder
show which process is listening on port 8080 | list the 20 most recently modified files
delete log files older than 14 days | compress a folder into a tar.gz archive
print the disk usage of each subdirectory, largest first
check whether a remote host is reachable | rename files to replace spaces with underscores
print the third column of a CSV file | count the unique IP addresses in an access log
follow a log file and show only lines containing ERROR
run a command every five minutes with cron | copy a directory to a remote server with rsync
make a copy of a file with a timestamp in its name
print the uptime of a list of servers over ssh | sort a file numerically by its second column
print the lines that are in one file but not in another
convert every PNG in a folder to JPEG with ImageMagick
list last week's git commits grouped by author | measure how long a command takes
split a large file into 100 MB pieces
search a directory tree for a string and show line numbers
create an alias that survives a new terminal session | print memory usage every second
""")

SHELL_REQS = ("Explain each flag.", "Make it safe to run twice.", "Show a dry-run version first.",
              "Use only POSIX tools.", "Add a comment to each line.",
              "Mention how it differs on macOS.", "Handle file names with spaces.",
              "Keep it to a single line if you can.")

CODE_TOPICS = _split("""
the difference between a process and a thread | what a race condition is
how garbage collection works in Python | the difference between a list and a tuple in Python
what Big-O notation means | how HTTP cookies work | the trade-offs between REST and GraphQL
what a database index is | the different kinds of SQL joins | what dependency injection is
how git rebase differs from git merge | what a memory leak is
the difference between TCP and UDP | what a container image is
how async and await work in Python | what a closure is
the difference between unit tests and integration tests | what continuous integration is
how a dictionary uses hashing | what a deadlock is | the CAP theorem | how DNS resolution works
what an API rate limit is | why immutability is useful | what a Python virtual environment is
how CSS flexbox lays out items | what the JavaScript event loop does
the difference between == and is in Python | what a foreign key is
what SQL injection is and how to prevent it | what a Makefile is for
how caching speeds up a web application | how regular expressions work
what type hints add to Python code | what a generator is in Python
how pagination works in a web API | what semantic versioning means | what a load balancer does
what an ORM is
""")

CODE_TOPIC_EXTRAS = ("", "Use Python for any examples.", "Keep it under 200 words.",
                     "Include a common pitfall.", "Assume I know basic programming.",
                     "Give a real-world analogy.")

# (language, code fence, what it should do, what goes wrong, code)
BUGGY_SNIPPETS = (
    ("Python", "python", "return the mean of a list of numbers", "it crashes on an empty list",
     ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
      "    return total / len(values)")),
    ("Python", "python", "add a tag to a fresh list on each call",
     "tags from earlier calls keep showing up",
     "def add_tag(tag, tags=[]):\n    tags.append(tag)\n    return tags"),
    ("Python", "python", "return the last n lines", "it returns one line too many",
     "def tail(lines, n):\n    return lines[len(lines) - n - 1:]"),
    ("Python", "python", "check whether a user is an administrator",
     "it returns False for some roles read from a file",
     "def is_admin(role):\n    return role is \"admin\""),
    ("Python", "python", "remove blank names from a list", "some blank entries survive",
     ("def drop_blank(names):\n    for name in names:\n        if not name.strip():\n"
      "            names.remove(name)\n    return names")),
    ("Python", "python", "print [0, 10, 20]", "it prints [20, 20, 20]",
     ("callbacks = []\nfor i in range(3):\n    callbacks.append(lambda: i * 10)\n"
      "print([f() for f in callbacks])")),
    ("Python", "python", "count the words in a text file",
     "the count is wrong for files with several lines",
     ("def count_words(path):\n    f = open(path)\n    words = f.read().split(\" \")\n"
      "    return len(words)")),
    ("Python", "python", "return a percentage with two decimals",
     "it returns 33.0 instead of 33.33",
     "def percent(part, whole):\n    return round(part / whole, 2) * 100"),
    ("Python", "python", "count items per color", "it raises KeyError on the first item",
     ("def count_colors(items):\n    counts = {}\n    for item in items:\n"
      "        counts[item[\"color\"]] += 1\n    return counts")),
    ("JavaScript", "javascript", "add up a list of prices", "it always returns 0",
     ("function total(prices) {\n  let sum = 0;\n  prices.forEach(p => { sum + p; });\n"
      "  return sum;\n}")),
    ("JavaScript", "javascript", "load a user from an API",
     "it throws 'res.json is not a function'",
     ("async function loadUser(id) {\n  const res = fetch(`/api/users/${id}`);\n"
      "  return res.json();\n}")),
    ("JavaScript", "javascript", "print the highest score", "it prints 9 instead of 100",
     ("const scores = [10, 9, 100, 25];\nscores.sort();\n"
      "console.log(scores[scores.length - 1]);")),
    ("SQL", "sql", "list departments whose average salary is above 50000",
     "the database rejects it with an error about aggregates",
     ("SELECT department, AVG(salary)\nFROM employees\nWHERE AVG(salary) > 50000\n"
      "GROUP BY department;")),
    ("bash", "bash", "move every .txt file into backup/",
     "it fails for file names that contain spaces",
     "for f in $(ls *.txt); do\n  mv $f backup/$f\ndone"),
    ("Python", "python", "give each basket its own list of items",
     "every basket ends up with the same items",
     "class Basket:\n    items = []\n\n    def add(self, item):\n        self.items.append(item)"),
    ("Python", "python", "count the days until a date written like '2025-03-28'",
     "it raises ValueError for that date",
     ("from datetime import datetime\n\ndef days_until(text):\n"
      "    target = datetime.strptime(text, \"%Y-%d-%m\")\n"
     "    return (target - datetime.now()).days")),
    ("Go", "go", "add up a slice of integers", "the result is always too small",
     ("func total(nums []int) int {\n    t := 0\n    for i := 1; i < len(nums); i++ {\n"
      "        t += nums[i]\n    }\n    return t\n}")),
    ("Python", "python", "load settings from a JSON file",
     "a typo in the file silently gives empty settings",
     ("import json\n\ndef read_config(path):\n    try:\n        with open(path) as f:\n"
      "            return json.load(f)\n    except Exception:\n        return {}")),
)

DEBUG_REQS = ("Show the corrected code.", "Explain the bug in one paragraph, then fix it.",
              "Suggest a test that would have caught it.", "Point out any other problems too.",
              "Keep the fix as small as possible.", "Explain why the code behaves this way.",
              "Give the fixed version and a one-line explanation.",
              "Fix it, then rewrite it more cleanly.", "Explain it to a beginner.",
              "Tell me how a debugger could have shown the problem.")

# -------------------------------------------------------------------------------- math

NAMES_A = ("Ana", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro")
NAMES_B = ("Ivan", "Julia", "Kofi", "Lena", "Mateo", "Nadia", "Oscar", "Priya")
NAMES_C = ("Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wendy", "Yusuf")
NAMES_D = ("Zara", "Aiden", "Bea", "Caleb", "Dana", "Eli", "Fatima", "Gus")

WORD_PROBLEMS = (
    ("A bakery sells {a} loaves on each weekday and {b} on each weekend day. "
     "How many loaves does it sell in {w} weeks?"),
    ("A train leaves at {h}:00 and travels {d} km at an average of {v} km/h. "
     "At what time does it arrive?"),
    ("{n1} saves ${a} a week and already has ${b}. How many weeks until {n1} can buy "
     "a bike that costs ${c}?"),
    ("A rectangular garden is {a} m long and {b} m wide, with a path {w} m wide all around "
     "the outside. What is the area of the path?"),
    ("A recipe for 4 people uses {a} g of flour and {w} eggs. How much of each is needed "
     "for {b} people?"),
    ("A jacket costs ${c}. It is discounted by {p}%, and then {w}% sales tax is added. "
     "What is the final price?"),
    ("Two cyclists start {d} km apart and ride toward each other at {a} km/h and {b} km/h. "
     "How long until they meet?"),
    ("One pipe fills a tank in {u} hours and a drain empties it in {h} hours. With both open, "
     "how long does it take to fill the empty tank?"),
    ("{n1} earns ${a} an hour and works {b} hours a week. After {p}% tax, how much does "
     "{n1} take home over {w} weeks?"),
    ("A phone plan costs ${a} a month plus $4 for each gigabyte above 10 GB. "
     "What is the bill in a month with {b} GB used?"),
    ("A school orders {a} boxes of pencils with {b} pencils per box and shares them equally "
     "among {w} classes. How many does each class get, and how many are left over?"),
    "A concert ticket went from ${a} to ${c}. By what percentage did the price rise?",
    ("A car uses {w} litres of fuel per 100 km and fuel costs ${a} per 20 litres. "
     "How much does a {d} km trip cost?"),
    "A farm has {a} chickens and {b} goats. How many legs are there on the farm in total?",
    ("A painter can paint a fence in {w} hours and a helper can do it in {h} hours. "
     "How long do they take working together?"),
    "A video is {a} minutes long. How long does it take to watch at {s}x speed?",
    ("{n1} reads {a} pages a day and {n2} reads {b} pages a day. The book has {d} pages. "
     "How many days sooner does the faster reader finish?"),
    "A water bottle holds {a} cl. How many bottles are needed to fill a {w}-litre jug?",
)

MATH_SLOTS = MappingProxyType({
    "u": _nums(2, 6),
    "a": _nums(12, 60, 3), "b": _nums(14, 80, 4), "c": _nums(90, 400, 15),
    "d": _nums(120, 600, 30), "h": _nums(6, 15), "v": _nums(60, 130, 10), "w": _nums(2, 9),
    "p": _nums(5, 45, 5), "s": ("1.25", "1.5", "1.75", "2"), "n1": NAMES_A, "n2": NAMES_B,
})

MATH_EXTRAS = ("", "Show your work step by step.", "Explain your reasoning.",
               "Give the final answer on its own line.", "Check your answer at the end.")

ALGEBRA = (
    "Solve for x: {a}x + {b} = {c}.",
    "Solve the system of equations x + y = {c} and x - y = {a}.",
    "What is {p}% of {c}?",
    "Simplify the fraction {a}/{c}.",
    "Find the derivative of g(t) = {w}t^3 + {a}t^2 - {b}t.",
    "Factor the quadratic {quad}.",
    "Convert {a} km/h to metres per second.",
    "A circle has a radius of {w} cm. Find its area and circumference.",
    "Evaluate {a} * ({b} + {w}) - {c} / 5.",
    "What is the least common multiple of {a} and {b}?",
    "If {w} workers build a wall in {a} days, how long would {h} workers take at the same pace?",
    "Expand and simplify ({w}y + {a})(y - {b}).",
    "An arithmetic sequence begins {seq}. Find its 20th term.",
    "Solve the inequality {w}x - {a} > {b} and describe the solution set.",
    "Write {a}/{c} as a decimal and as a percentage.",
    "A square has an area of {c} square metres. How long is its side, to two decimals?",
)

QUADRATICS = tuple(f"y^2 + {r + s}y + {r * s}" for r in range(1, 10) for s in range(r, 10))
SEQUENCES = tuple(f"{x}, {x + k}, {x + 2 * k}, {x + 3 * k}" for x in range(2, 12)
                  for k in range(3, 9))
PATTERNS = (SEQUENCES
            + tuple(", ".join(str(i * i + k) for i in range(1, 6)) for k in range(10))
            + tuple(", ".join(str(x * 3**i) for i in range(4)) for x in range(1, 10)))

LOGIC = (
    ("{n1} finished a race before {n2}, {n3} finished after {n2}, and {n4} finished between "
     "{n1} and {n2}. In what order did they finish?"),
    ("{n1} is older than {n2}. {n3} is younger than {n2} but older than {n4}. "
     "List the four from oldest to youngest."),
    "A clock shows {h}:{m}. What is the angle between the hour and minute hands?",
    "If today is {day}, what day of the week will it be in {k} days?",
    ("A snail climbs {u} m up a {t} m wall each day and slips back 1 m each night. "
     "On which day does it reach the top?"),
    ("You have a {jug[0]}-litre jug and a {jug[1]}-litre jug and a tap. How can you measure "
     "exactly {jug[2]} litres?"),
    "What number comes next after {seq}? Explain the pattern.",
    ("{n1} says {n2} is lying. {n2} says {n3} is lying. {n3} says {n1} and {n2} are both lying. "
     "Who is telling the truth?"),
    ("At a meeting of {k} people, everyone shakes hands with everyone else once. "
     "How many handshakes are there?"),
    ("{n1}, {n2} and {n3} each own one pet: a cat, a dog or a parrot. {n1} is allergic to fur "
     "and {n2} walks their pet every morning. Who owns which pet?"),
    ("Four friends sit in a row of four chairs. {n1} is not at either end, {n2} sits directly "
     "left of {n3}, and {n4} has the right end. Where does everyone sit?"),
)

JUGS = tuple((a, b, c) for a, b in ((3, 5), (4, 7), (5, 8), (3, 7), (4, 9), (5, 7))
             for c in range(2, b) if c != a)

LOGIC_SLOTS = MappingProxyType({
    "n1": NAMES_A, "n2": NAMES_B, "n3": NAMES_C, "n4": NAMES_D, "h": _nums(1, 13),
    "m": ("00", "10", "15", "20", "30", "40", "45", "50"), "k": _nums(5, 40),
    "day": ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"),
    "u": _nums(3, 6), "t": _nums(10, 31), "jug": JUGS, "seq": PATTERNS,
})

PROBABILITY = (
    ("A bag holds {r} red, {b} blue and {g} green marbles. If you draw two without putting "
     "the first back, what is the chance both are {color}?"),
    "A fair coin is tossed {n} times. What is the probability of exactly {k} heads?",
    "Find the mean, median and range of these numbers: {data}.",
    "From a shuffled 52-card deck, what is the probability of drawing {card}?",
    ("A spinner has {n} equal sections numbered 1 to {n}. What is the chance of landing on an "
     "even number twice in a row?"),
    "The weights of some parcels in kg are {data}. Compute their standard deviation.",
    ("A team wins {r}0% of home games and {g}0% of away games, and half its games are at home. "
     "What share of games does it win overall?"),
    ("How many different {k}-letter codes can be made from the letters of '{word}' if no "
     "letter repeats?"),
    "In how many ways can {n} people sit around a round table?",
    ("A quiz has {n} true-or-false questions. If someone guesses every answer, what is the "
     "chance they get at least {k} right?"),
)

PROBABILITY_SLOTS = MappingProxyType({
    "r": _nums(2, 9), "b": _nums(3, 10), "g": _nums(1, 8), "n": _nums(4, 11),
    "k": _nums(1, 4), "color": ("red", "blue", "green"),
    "data": tuple(", ".join(str((7 * i + 11 * j) % 40 + 3) for j in range(6 + i % 3))
                  for i in range(30)),
    "card": ("a heart", "a face card", "an ace or a king", "a red seven", "a black card",
             "a number card below 5", "the queen of spades"),
    "word": ("PLANET", "GARDEN", "BRICK", "STORM", "CANDLE"),
})


# -------------------------------------------------------------------------- categories


def _with(templates: tuple[str, ...], suffix: str) -> tuple[str, ...]:
    return tuple(f"{t} {suffix}" for t in templates)


def _cat(name: str, group: str, weight: float, templates: tuple[str, ...],
         **slots: tuple) -> CategorySpec:
    return CategorySpec(name, group, weight, templates, MappingProxyType(slots))


_CODE_BLOCK = "\n\n```{bug[1]}\n{bug[4]}\n```\n\n{req}"

# Mix, like ShareGPT: general chat 0.60, code 0.25, math and reasoning 0.15.
CATEGORIES = (
    _cat("explain", "general", 0.07, (
        "Explain {concept} to {audience}. {style}",
        "Help {audience} understand {concept}. {style}",
        "Write a short explainer on {concept} for {audience}. {style}",
        "Can you give {audience} an intuitive picture of {concept}? {style}",
        "I keep hearing about {concept}. Break it down for {audience}. {style}",
    ), concept=CONCEPTS, audience=AUDIENCES, style=EXPLAIN_STYLES),
    _cat("how_to", "general", 0.06, (
        "How do I {task}? {extra}",
        "Walk me through how to {task}, step by step. {extra}",
        "I'm a complete beginner. What is the best way to {task}? {extra}",
        "Give me a practical checklist to {task}. {extra}",
    ), task=HOWTO_TASKS, extra=HOWTO_EXTRAS),
    _cat("essay", "general", 0.05, (
        "Write a short essay about {topic}. {angle} {length}",
        "Write a reflective piece on {topic}. {length} {angle}",
        "Write a {tone} opinion piece arguing that {claim}. {angle}",
    ), topic=ESSAY_TOPICS, angle=ESSAY_ANGLES, length=ESSAY_LENGTHS, tone=ESSAY_TONES,
        claim=ESSAY_CLAIMS),
    _cat("story", "general", 0.06, (
        "Write a short story about {character} who {situation}. Set it in {setting}. {extra}",
        "Tell a bedtime story about {character} who {situation}, set in {setting}. {extra}",
    ), character=CHARACTERS, situation=SITUATIONS, setting=SETTINGS, extra=STORY_EXTRAS),
    _cat("email", "general", 0.05, (
        "Write an email {purpose}. {tone} {shape}",
        "Draft a short message {purpose}. {shape} {tone}",
        "Help me write an email {purpose}. {tone} {shape}",
    ), purpose=EMAIL_PURPOSES, tone=EMAIL_TONES, shape=EMAIL_SHAPES),
    _cat("lists", "general", 0.05, (
        "List {count} {things}. {fmt}",
        "Give me {count} {things}, with one sentence on each.",
        "Brainstorm {count} {things}. {fmt}",
    ), count=COUNTS, things=LIST_THINGS, fmt=LIST_FORMATS),
    _cat("compare", "general", 0.05, (
        "Compare {pair} {angle}. {fmt}",
        "What are the main differences between {pair}? Answer {angle}. {fmt}",
        "Help me choose between {pair}. Focus on what matters {angle}. {fmt}",
    ), pair=COMPARE_PAIRS, angle=COMPARE_ANGLES, fmt=COMPARE_FORMATS),
    _cat("summarize", "general", 0.03, ("{task}\n\n{text}", "{text}\n\n{task}"),
         task=SUMMARY_TASKS, text=PARAGRAPHS),
    _cat("roleplay", "general", 0.05, (
        "You are {role}. {question}",
        "Stay in character as {role} and answer this: {question}",
        "Let's play a game: you are {role} and I am a visitor. {question}",
    ), role=ROLES, question=ROLE_QUESTIONS),
    _cat("constrained_writing", "general", 0.05, (
        "Write a {form} about {theme} that {rule_a} and {rule_b}.",
        ("Create a {form} on the theme of {theme}. It must follow two rules: it {rule_a}, "
         "and it {rule_b}."),
    ), form=FORMS, theme=THEMES, rule_a=RULES_A, rule_b=RULES_B),
    _cat("advice", "general", 0.05, (
        "{dilemma} What should I do? {extra}",
        "I need some advice. {dilemma} {extra}",
        "{dilemma} How would you handle this? {extra}",
        "Quick question for you. {dilemma} Any ideas? {extra}",
        "{dilemma} What are my options? {extra}",
    ), dilemma=DILEMMAS, extra=DILEMMA_EXTRAS),
    _cat("rewrite", "general", 0.03, (
        "Rewrite this sentence so it sounds {style}: \"{sentence}\"",
        "Make the following text {style} and explain what you changed: \"{sentence}\"",
        "Give two versions of this sentence that are {style}: \"{sentence}\"",
    ), style=REWRITE_STYLES, sentence=SENTENCES),
    _cat("python_function", "code", 0.055, (
        "Write a Python function `{fn[0]}` that {fn[1]}. {req}",
        "In Python, implement `{fn[0]}`, a function that {fn[1]}. {req}",
        "I need a Python helper called `{fn[0]}` that {fn[1]}. {req}",
        "Could you code a Python function named `{fn[0]}`? It {fn[1]}. {req}",
    ), fn=PY_FUNCTIONS, req=FUNCTION_REQS),
    _cat("python_class", "code", 0.03, (
        "Write a Python class `{cls[0]}` that implements {cls[1]}. {req}",
        "Design a Python class called `{cls[0]}`: {cls[1]}. {req}",
        "Implement {cls[1]} in Python as a class named `{cls[0]}`. {req}",
    ), cls=PY_CLASSES, req=CLASS_REQS),
    _cat("python_script", "code", 0.025, (
        "Write a Python script that {task}. {req}",
        "Create a small command-line Python program that {task}. {req}",
        "I need a Python script which {task}. {req}",
    ), task=SCRIPT_TASKS, req=SCRIPT_REQS),
    _cat("other_language", "code", 0.03, (
        "Write a {lang} function that {spec}. {req}",
        "How would you write a function in {lang} that {spec}? {req}",
    ), lang=LANGUAGES, spec=PORTABLE_SPECS, req=LANGUAGE_REQS),
    _cat("sql", "code", 0.025, (
        "Given the tables {sq[0]}, write a SQL query that {sq[1]}. {req}",
        "Using the schema {sq[0]}, write SQL that {sq[1]}. {req}",
        "I have these tables: {sq[0]}. How do I write a query that {sq[1]}? {req}",
        "Write a query that {sq[1]}, for a database with {sq[0]}. {req}",
    ), sq=SQL_TASKS, req=SQL_REQS),
    _cat("shell", "code", 0.025, (
        "How do I {task} from the Linux command line? {req}",
        "Write a bash one-liner to {task}. {req}",
        "Write a short shell script to {task}. {req}",
    ), task=SHELL_TASKS, req=SHELL_REQS),
    _cat("debugging", "code", 0.02, (
        "This {bug[0]} code should {bug[2]}, but {bug[3]}. What is wrong?" + _CODE_BLOCK,
        "Can you find the bug? The code below is meant to {bug[2]}, but {bug[3]}."
        + _CODE_BLOCK,
        "I'm stuck on this {bug[0]} snippet. It is supposed to {bug[2]}, yet {bug[3]}."
        + _CODE_BLOCK,
    ), bug=BUGGY_SNIPPETS, req=DEBUG_REQS),
    _cat("code_concepts", "code", 0.04, (
        "Explain {topic}. {extra}",
        "Help me understand {topic}. {extra}",
        "I'm preparing for a job interview. Explain {topic}. {extra}",
        "Teach me {topic}, with a small example. {extra}",
    ), topic=CODE_TOPICS, extra=CODE_TOPIC_EXTRAS),
    _cat("word_problem", "math", 0.06, _with(WORD_PROBLEMS, "{extra}"),
         extra=MATH_EXTRAS, **MATH_SLOTS),
    _cat("algebra", "math", 0.04, _with(ALGEBRA, "{extra}"),
         extra=MATH_EXTRAS, quad=QUADRATICS, seq=SEQUENCES,
         **{name: MATH_SLOTS[name] for name in ("a", "b", "c", "h", "p", "w")}),
    _cat("logic", "math", 0.025, _with(LOGIC, "{extra}"), extra=MATH_EXTRAS, **LOGIC_SLOTS),
    _cat("probability", "math", 0.025, _with(PROBABILITY, "{extra}"),
         extra=MATH_EXTRAS, **PROBABILITY_SLOTS),
)
